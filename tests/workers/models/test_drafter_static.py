"""The drafter's capturable pass (``forward_at``: device-side length, whole cache under a mask) must
equal its plain pass round after round, with new contexts of every length a round can commit, also
when the count of new context rows is a device scalar over a padded context, and after a prompt's
context but its last block was written ahead (a generation's first draft on CUDA)."""

from __future__ import annotations

import pytest
import torch

from tests.workers.models.test_drafter_attention import BLOCK, CASES, drafter_for, inputs

ROUNDS = (4, 1, 6, 2, 5, 1, 3, 6)  # a prompt of 4 (within one block), then rounds committing 1..6 tokens


def test_forward_at_equals_forward_over_rounds(tiny):
    drafter, embed = tiny.drafter, tiny.model.get_input_embeddings()
    width = drafter.fc.weight.shape[1]
    generator = torch.Generator().manual_seed(0)
    plain, static = drafter.new_cache(256), drafter.new_cache(256)
    length = torch.zeros((), dtype=torch.long)
    with torch.inference_mode():
        for num_new in (11, 1, 3, 8, 2, 5, 1, 7):  # the prompt, then rounds accepting 0..6 drafts
            context = torch.randn(1, num_new, width, generator=generator)
            block = torch.full((1, drafter.block_size), drafter.spec.mask_token_id)
            block[0, 0] = int(torch.randint(1, 30, (1,), generator=generator))
            embeds = embed(block)
            want = drafter(embeds, context, plain)
            length.fill_(static.length)
            got = drafter.forward_at(embeds, context, static, length)
            static.length += num_new
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert plain.length == static.length == 38


@pytest.mark.parametrize("case", ["plain DFlash", "Qwen3.6-27B layout", "window inside the block"])
@pytest.mark.parametrize("fused", [True, False])
def test_a_counted_pass_over_padded_context_equals_the_plain_pass(case, fused):
    """The engines queue the next draft before the host knows how many tokens were committed: the
    pass takes ``block_size`` context rows of which the first ``count`` (a device scalar) are new.
    The padding (anything finite: here large random rows) must change nothing, in this pass or the
    ones after it, with windows shorter than the block among the layers."""
    layers, change, _ = CASES[case]
    drafter = drafter_for(layers, change)
    taps, block_embeds = inputs(drafter, sum(ROUNDS))
    generator = torch.Generator().manual_seed(2)
    padded_rows = drafter.block_size
    plain, counted = drafter.new_cache(96), drafter.new_cache(96)
    with torch.inference_mode():
        for new in ROUNDS:
            context = taps[None, plain.length : plain.length + new]
            want = drafter(block_embeds[None], context, plain)
            padded = 10 * torch.randn(1, padded_rows, taps.shape[1], generator=generator)
            padded[:, :new] = context
            got = drafter.forward_at(block_embeds[None], padded, counted, torch.tensor(counted.length),
                                     fused=fused, count=torch.tensor(new))
            counted.length += new
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("case", ["plain DFlash", "Qwen3.6-27B layout", "window inside the block"])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("prompt, chunk", [(BLOCK + 1, 5), (3 * BLOCK + 2, 5), (3 * BLOCK + 2, 7), (3 * BLOCK + 2, 64)])
def test_a_prompt_written_ahead_then_drafted_as_a_round_equals_the_plain_pass(case, fused, prompt, chunk):
    """``GraphDrafting``'s first draft: a prompt longer than a block has its leading rows' K/V written
    ahead (``write_ahead``, a chunk of rows at a time: here the function its graph records) and its
    last block of rows taken by the round's counted pass. That pass, and the rounds after it, must
    give the plain pass's hidden states, past every window; the cache must hold the same K/V (the
    order of the writes changed; chunks overlap, and one longer than the prompt writes padding)."""
    from workers.decoding.drafting import GraphDrafting

    layers, change, _ = CASES[case]
    drafter = drafter_for(layers, change)
    taps, block_embeds = inputs(drafter, prompt + sum(ROUNDS))
    plain = drafter.new_cache(96)
    ahead = GraphDrafting(drafter, None, 96, fused=fused, chunk=chunk)
    with torch.inference_mode():
        for new in (prompt, *ROUNDS):
            context = taps[None, plain.length : plain.length + new]
            want = drafter(block_embeds[None], context, plain)
            leading = max(0, new - BLOCK)
            if leading:
                ahead.write_ahead(context[:, :leading])
            assert ahead.cache.length == plain.length - new + leading
            last = context[:, leading:]
            padded = torch.zeros(1, BLOCK, taps.shape[1])
            padded[:, : last.shape[1]] = last
            got = drafter.forward_at(block_embeds[None], padded, ahead.cache, torch.tensor(ahead.cache.length),
                                     fused=fused, count=torch.tensor(last.shape[1]))
            ahead.advance(last.shape[1])
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
        for kept, written in zip(plain.pairs, ahead.cache.pairs, strict=True):
            torch.testing.assert_close(written[:, :, :, : plain.length], kept[:, :, :, : plain.length])


@pytest.mark.parametrize("fused", [True, False])
def test_graph_drafting_moves_the_drafter_weights_before_any_capture(fused):
    """A drafter's first fused pass regroups its layers' q/k/v and gate/up weights into new storage and
    frees the old, so a graph captured before it would read freed memory (a GPU run of the write-ahead
    graph did). ``GraphDrafting`` fuses when it is made, fused or not: the weights move then, and no
    pass after that moves them again."""
    from workers.decoding.drafting import GraphDrafting

    drafter = drafter_for(*CASES["Qwen3.6-27B layout"][:2])
    taps, block_embeds = inputs(drafter, 2 * BLOCK)

    def addresses() -> list[int]:
        return [p.data_ptr() for layer in drafter.layers for p in layer.parameters()]

    before = addresses()
    drafting = GraphDrafting(drafter, None, 96, fused=fused, chunk=5)
    made = addresses()
    assert made != before, "the weights did not move when the drafting object was made"
    with torch.inference_mode():
        drafting.write_ahead(taps[None, :BLOCK])
        drafter.forward_at(block_embeds[None], taps[None, BLOCK:], drafting.cache,
                           torch.tensor(drafting.cache.length), fused=True)
    assert addresses() == made


def test_chunk_starts_cover_the_leading_rows_once_or_twice():
    """Each row of a prompt's leading context is written by one chunk, or by two where the last chunk
    was moved back; no chunk reaches past the leading rows unless there is only one."""
    from workers.decoding.drafting import chunk_starts

    assert chunk_starts(3, 5) == [0] and chunk_starts(5, 5) == [0] and chunk_starts(6, 5) == [0, 1]
    assert chunk_starts(1008, 256) == [0, 256, 512, 752]
    for chunk in (1, 4, 5, 256):
        for leading in range(chunk + 1, 3 * chunk + 3):
            starts = chunk_starts(leading, chunk)
            written = torch.zeros(leading, dtype=torch.long)
            for start in starts:
                assert 0 <= start <= leading - chunk
                written[start : start + chunk] += 1
            assert bool((written >= 1).all()) and bool((written <= 2).all())
            assert len(starts) == -(-leading // chunk)


def test_context_slots_keep_the_padding_past_the_block():
    """A counted pass's slots: the new context at length.., the block right after it, the padding past
    the block, all distinct, so that no two rows of one pass write one K/V slot (on a GPU the order of
    such writes is unknown; on the CPU the later one wins, so the pass tests above cannot see a clash)."""
    from workers.models.fused_drafter import context_slots

    length, rows, block = torch.tensor(37), 16, 16
    assert torch.equal(context_slots(length, rows, block, None), 37 + torch.arange(rows + block))
    for count in range(rows + 1):
        slots = context_slots(length, rows, block, torch.tensor(count))
        assert len(set(slots.tolist())) == rows + block
        assert torch.equal(slots[:count], 37 + torch.arange(count))  # the new context
        assert torch.equal(slots[rows:], 37 + count + torch.arange(block))  # the block right after it
        assert bool((slots[count:rows] >= 37 + count + block).all())  # the padding past the block
