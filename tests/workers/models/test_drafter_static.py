"""The drafter's capturable pass (``forward_at``: device-side length, whole cache under a mask) must
equal its plain pass round after round, with new contexts of every length a round can commit."""

from __future__ import annotations

import torch


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
