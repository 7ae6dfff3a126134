"""StaticTarget against transformers' own forward: every verified node, after every commit.

transformers runs a hybrid model correctly on a plain sequence; it is the reference here (float32;
the tolerance covers summation-order noise through these large random weights, ~1e-4 on logits of
magnitude ~5, far below the 1e-2..1e-1 a leaked sibling state causes). The
runner must give the same logits for a chunked prompt, for every node of a tree (as if that node's
path alone had been appended to the prompt), and after committing any path. Also: taps, AR equal to
``model.generate``, the ``tree_state_bytes`` accounting, and a trial through the real Worker.
"""

from __future__ import annotations

import pytest
import torch

from workers.decoding import ar, ddtree
from workers.decoding.generation import GenerationConfig
from workers.decoding.params import TreeParams
from workers.decoding.tree import build_tree
from workers.models.gdn import full_state_bytes, tree_state_bytes
from workers.models.runner.target import StaticTarget

pytestmark = pytest.mark.usefixtures("one_torch_thread")
HYBRIDS = ("tiny_hybrid", "tiny_next")


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def random_ids(vocab: int, length: int, seed: int) -> list[int]:
    return torch.randint(1, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def random_tree(vocab: int, budget: int, depth: int, seed: int):
    log_probs = torch.log_softmax(torch.randn(depth, vocab, generator=torch.Generator().manual_seed(seed)) * 2, dim=-1)
    return build_tree(log_probs, TreeParams(budget, max_depth=depth))


def path_to(tree, node: int) -> list[int]:
    path = [node]
    while tree.parents[path[-1]] > 0:
        path.append(int(tree.parents[path[-1]]))
    return path[::-1] if node > 0 else []


@pytest.mark.parametrize("name", HYBRIDS)
@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_chunked_prefill_and_chain_match_the_plain_forward(request, name, chunk):
    tiny = request.getfixturevalue(name)
    vocab = tiny.shape.vocab_size
    prompt, more = random_ids(vocab, 13, chunk), random_ids(vocab, 5, chunk + 1)
    target = StaticTarget(tiny.model, prefill_chunk=chunk)
    target.start(capacity=64, max_verify=8)
    with torch.no_grad():
        first = target.prefill(torch.tensor([prompt]))
        torch.testing.assert_close(first.logits[0], reference_logits(tiny.model, prompt)[-1], atol=3e-4, rtol=1e-4)
        chain = target.verify_chain(torch.tensor(more))
    torch.testing.assert_close(chain.logits, reference_logits(tiny.model, prompt + more)[-5:], atol=3e-4, rtol=1e-4)


@pytest.mark.parametrize("name", HYBRIDS)
@pytest.mark.parametrize("seed", range(4))
def test_every_tree_node_sees_only_its_own_path_and_any_path_commits(request, name, seed):
    """Node logits = plain forward on prompt + root + that node's path; after committing a path
    (off the first chain when there is one), the next pass = plain forward on the extended text."""
    tiny = request.getfixturevalue(name)
    vocab = tiny.shape.vocab_size
    prompt, root = random_ids(vocab, 6 + seed, seed), 1 + seed % (vocab - 1)
    tree = random_tree(vocab, budget=6 + 5 * seed, depth=4, seed=seed)
    target = StaticTarget(tiny.model, tap_layer_ids=tiny.drafter.spec.target_layer_ids)
    target.start(capacity=128, max_verify=64)
    with torch.no_grad():
        target.prefill(torch.tensor([prompt]))
        verified = target.verify_tree(torch.tensor(root), tree)
    assert verified.logits.shape[0] == 1 + tree.num_nodes
    for node in range(1 + tree.num_nodes):
        text = prompt + [root] + [int(tree.tokens[i - 1]) for i in path_to(tree, node)]
        torch.testing.assert_close(verified.logits[node], reference_logits(tiny.model, text)[-1], atol=3e-4, rtol=1e-4)

    # commit the path to the deepest node that is not on the first chain (the last node otherwise)
    chain = {0}
    for i in range(1, 1 + tree.num_nodes):
        if int(tree.parents[i]) in chain and int(tree.parents[i]) == max(chain):
            chain.add(i)
    off = [i for i in range(1, 1 + tree.num_nodes) if i not in chain] or [tree.num_nodes]
    accepted = max(off, key=lambda i: (int(tree.depths[i - 1]), i))
    kept = [0, *path_to(tree, accepted)]
    with torch.no_grad():
        target.commit(torch.tensor(kept))
        follow = random_ids(vocab, 3, 50 + seed)
        after = target.verify_chain(torch.tensor(follow))
    text = prompt + [root] + [int(tree.tokens[i - 1]) for i in kept[1:]] + follow
    torch.testing.assert_close(after.logits, reference_logits(tiny.model, text)[-3:], atol=3e-4, rtol=1e-4)
    assert target.length == len(text) - 3


@pytest.mark.parametrize("name", (*HYBRIDS, "tiny"))
@pytest.mark.parametrize("runner", ["static", "attention"])
def test_advance_equals_the_plain_forward_and_leaves_the_text_committed(request, name, runner):
    """``advance`` (AR's round: tokens kept as they are verified) gives the plain forward's last logits
    and the tapped layers' states of its tokens, and leaves them committed: the next pass sees the
    extended text. One token and a few at a time (the recurrence and the chunked form)."""
    tiny = request.getfixturevalue(name)
    if runner == "attention" and name != "tiny":
        pytest.skip("AttentionTarget runs attention-only models")
    from tests.helpers.reference import AttentionTarget

    taps = tiny.drafter.spec.target_layer_ids
    target = StaticTarget(tiny.model, tap_layer_ids=taps) if runner == "static" else AttentionTarget(tiny.model, taps)
    vocab = tiny.shape.vocab_size
    text = random_ids(vocab, 7, 91)
    target.start(capacity=64, max_verify=8)
    with torch.no_grad():
        target.prefill(torch.tensor([text]))
        for count in (1, 3, 1, 5):
            more = random_ids(vocab, count, 92 + count + len(text))
            out = target.advance(torch.tensor(more))
            text += more
            hidden = tiny.model(torch.tensor([text]), output_hidden_states=True).hidden_states
            torch.testing.assert_close(out.logits, reference_logits(tiny.model, text)[-1:], atol=3e-4, rtol=1e-4)
            expected = torch.cat([hidden[i + 1][:, -count:] for i in taps], dim=-1)
            torch.testing.assert_close(out.taps, expected, atol=3e-4, rtol=1e-4)
            assert target.length == len(text)
        follow = random_ids(vocab, 3, 99)
        after = target.verify_chain(torch.tensor(follow))
    torch.testing.assert_close(after.logits, reference_logits(tiny.model, text + follow)[-3:], atol=3e-4, rtol=1e-4)


@pytest.mark.parametrize("name", HYBRIDS)
def test_taps_are_the_tapped_layers_hidden_states(request, name):
    tiny = request.getfixturevalue(name)
    taps = tiny.drafter.spec.target_layer_ids
    ids = random_ids(tiny.shape.vocab_size, 11, 5)
    target = StaticTarget(tiny.model, tap_layer_ids=taps, prefill_chunk=4)
    target.start(capacity=32, max_verify=4)
    with torch.no_grad():
        got = target.prefill(torch.tensor([ids])).taps
        hidden = tiny.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    expected = torch.cat([hidden[i + 1] for i in taps], dim=-1)  # hidden_states[0] is the embedding
    torch.testing.assert_close(got, expected, atol=3e-4, rtol=1e-4)


@pytest.mark.parametrize("name", HYBRIDS)
def test_ar_equals_transformers_generate(request, name):
    tiny = request.getfixturevalue(name)
    for seed in range(3):
        prompt = torch.tensor([random_ids(tiny.shape.vocab_size, 4 + 5 * seed, 70 + seed)])
        with torch.no_grad():
            expected = tiny.model.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None)
        out = ar.generate(tiny.target, None, prompt, GenerationConfig(max_new_tokens=24))
        assert out.token_ids == expected[0, prompt.shape[1] :].tolist()


def test_tree_state_bytes_are_per_node_vectors_not_states(tiny_next):
    """The extra bytes of a pass grow linearly in the node count, far below one state per node."""
    model = tiny_next.model
    target = StaticTarget(model)
    target.start(capacity=256, max_verify=128)
    sizes = {}
    with torch.no_grad():
        target.prefill(torch.tensor([random_ids(32, 5, 1)]))
        for budget in (8, 32, 96):
            target.verify_tree(torch.tensor(3), random_tree(32, budget, depth=7, seed=budget))
            sizes[1 + budget] = target.state_bytes
    for q, size in sizes.items():
        assert size == tree_state_bytes(model.config, q, torch.float32)
        assert size < full_state_bytes(model.config, q)
    assert target.peak_state_bytes == max(sizes.values())


def test_worker_trial_on_a_hybrid_target_reports_tree_state_bytes(tiny_hybrid):
    from workers.prompts import Prompt
    from workers.wire import TrialSpec, WorkerConfig
    from workers.worker import Worker

    worker = Worker(WorkerConfig(target=str(tiny_hybrid.target_dir), drafter=str(tiny_hybrid.drafter_dir),
                                 device="cpu", dtype="float32", local_files_only=True)).load()
    assert type(worker.target).__name__ == "StaticTarget"
    prompts = tuple(Prompt(input_ids=tuple(random_ids(6, 9, s))) for s in range(3))
    spec = TrialSpec(TreeParams(12), prompts, max_new_tokens=16, stop_token_ids=(), warmup=False)
    result = worker.run_trial(spec)
    assert result.status == "ok", result.error
    assert result.metrics["lossless_match"] == 1.0
    assert result.metrics["tree_state_bytes"] > 0
    assert result.metrics["tau"] > 1.0


def test_ddtree_at_temperature_runs_and_stays_in_vocab(tiny_hybrid):
    prompt = torch.tensor([random_ids(6, 7, 9)])
    config = GenerationConfig(max_new_tokens=30, temperature=0.8, seed=4)
    out = ddtree.generate(tiny_hybrid.target, tiny_hybrid.drafter, prompt, config, TreeParams(16))
    assert len(out.token_ids) == 30 and all(0 <= t < 7 for t in out.token_ids)


def test_negative_control_a_tree_mask_through_transformers_gets_branches_wrong(tiny_hybrid):
    """Why StaticTarget exists: the plain forward with a 4-D tree mask leaks siblings into the
    recurrent state. The same node-by-node comparison as above must catch that (errors >> tolerance)."""
    model, vocab = tiny_hybrid.model, tiny_hybrid.shape.vocab_size
    prompt, root = random_ids(vocab, 6, 0), 2
    tree = random_tree(vocab, budget=12, depth=3, seed=0)
    ids = torch.tensor([prompt + [root] + tree.tokens.tolist()])
    n, past = 1 + tree.num_nodes, len(prompt)
    mask = torch.zeros(1, 1, n, past + n)
    mask[0, 0, :, past:].masked_fill_(~tree.visibility, torch.finfo(torch.float32).min)
    positions = torch.tensor([list(range(past)) + [past + d for d in [0, *tree.depths.tolist()]]])
    with torch.no_grad():
        prefix = torch.zeros(1, 1, past, past).masked_fill_(torch.ones(past, past, dtype=torch.bool).triu(1), -3e38)
        full = torch.cat((torch.cat((prefix, torch.full((1, 1, past, n), -3e38)), dim=-1), mask), dim=2)
        leaky = model(ids, attention_mask=full, position_ids=positions).logits[0, past:]
    errors = []
    for node in range(n):
        text = prompt + [root] + [int(tree.tokens[i - 1]) for i in path_to(tree, node)]
        errors.append((leaky[node] - reference_logits(model, text)[-1]).abs().max().item())
    assert errors[0] < 3e-4 and errors[1] < 3e-4, errors  # root and first child: right (no sibling before them)
    assert max(errors) > 1e-2, errors  # branches off the first chain: wrong, silently
