"""efx.explain names every shape guard that failed (storage offsets and strides included) when a symbolic
program could not serve a call (Note [Symbolic shapes]; the words: ``effectfx.guards.words``)."""

from __future__ import annotations

import torch

import effectfx as efx

SYMBOLIC = "; symbolic sizes (automatic dynamic: sizes changed)"


def test_cropped_prompts_name_the_storage_offset():
    # nanoGPT's generate crops its prompt from the left: views of one buffer at growing offsets
    emb = torch.nn.Embedding(20, 4)

    def forward(idx):
        return emb(idx).sum(1)

    compiled = efx.compile(forward)
    tokens = torch.arange(12)[None]
    for k in range(4):
        torch.testing.assert_close(compiled(tokens[:, k:]), forward(tokens[:, k:]))
    whys = [p.why for p in efx.explain(compiled).programs]
    assert whys == [
        "first call",
        "idx: shape [1, 12] -> [1, 11] (vs signature 1)" + SYMBOLIC,
        "idx.storage_offset() == 1 failed: idx.storage_offset() = 2 (vs signature 2: a guard of its symbolic "
        "sizes)" + SYMBOLIC,
    ]


def test_strides_that_fail_are_named_with_their_values():
    def f(x):
        return x * 2

    compiled = efx.compile(f)
    base = torch.randn(8, 8)
    views = (base[:, :4].contiguous(), base[:5, :4].contiguous(), base[:5, :4], base[:6, :3],
             base.t()[:5, :4])
    for x in views:
        torch.testing.assert_close(compiled(x), f(x))
    whys = [p.why for p in efx.explain(compiled).programs]
    assert whys == [
        "first call",
        "x: shape [8, 4] -> [5, 4] (vs signature 1)" + SYMBOLIC,
        "x.stride()[0] == x.size()[1] failed: x.stride()[0] = 8, x.size()[1] = 4 (vs signature 2: a guard of "
        "its symbolic sizes)" + SYMBOLIC,
        # every guard of every symbolic program that failed on the transposed view
        "x.stride()[0] == x.size()[1] failed: x.stride()[0] = 1, x.size()[1] = 4; x.stride()[1] == 1 failed: "
        "x.stride()[1] = 8 (vs signature 2: a guard of its symbolic sizes); x.stride()[1] == 1 failed: "
        "x.stride()[1] = 8; 2 <= x.stride()[0] failed: x.stride()[0] = 1 (vs signature 3: a guard of its "
        "symbolic sizes)" + SYMBOLIC,
    ]
