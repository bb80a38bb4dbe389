"""The ViT segmenter: shapes, token order, position embeddings, decoder layout, parameter errors, sliding window."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distmis.models.unet3d_torch import count_trainable_parameters as count_parameters
from distmis.models.vit_seg import ConvDecoder, PatchEmbedding3D, ViTSeg, token_coordinates

TINY = dict(in_channels=2, num_classes=3, patch=4, layers=2, embed_dim=32, heads=4, mlp_ratio=2.0, decoder_features=16)


def tiny(tile=16, **kwargs) -> ViTSeg:
    torch.manual_seed(0)
    return ViTSeg(tile=tile, **{**TINY, **kwargs}).eval()


@pytest.mark.parametrize("tile", [16, (24, 8, 16)])
def test_shapes(tile):
    model = tiny(tile)
    x = torch.randn(2, 2, *model.tile)
    grid = tuple(s // 4 for s in model.tile)
    assert model.grid == grid and model.num_tokens == grid[0] * grid[1] * grid[2]
    tokens = model.embed(x)
    assert tokens.shape == (2, model.num_tokens, 32)
    encoded = model.encode(tokens)
    assert encoded.shape == tokens.shape
    assert model.decode(encoded).shape == (2, 3, *model.tile)
    assert model(x).shape == (2, 3, *model.tile)
    # a sub-volume decodes to its own size
    assert model.decode(encoded[:, :4], (1, 2, 2)).shape == (2, 3, 4, 8, 8)


def test_token_order_is_row_major_last_axis_fastest():
    # an (H, W, D) = (4, 4, 6) tile in 2^3 patches: a (2, 2, 3) grid; every voxel of patch (ih, iw, id) holds
    # 100 ih + 10 iw + id, and the embedding averages a patch, so each token shows where it came from
    embed = PatchEmbedding3D(in_channels=1, embed_dim=1, patch=2)
    with torch.no_grad():
        embed.proj.weight.fill_(1 / 8)
        embed.proj.bias.zero_()
    h, w, d = torch.meshgrid(torch.arange(4) // 2, torch.arange(4) // 2, torch.arange(6) // 2, indexing="ij")
    x = (100 * h + 10 * w + d).float()[None, None]
    tokens = embed(x)[0, :, 0]
    assert tokens.tolist() == pytest.approx([0, 1, 2, 10, 11, 12, 100, 101, 102, 110, 111, 112])
    assert token_coordinates(torch.tensor([0, 2, 3, 5, 6, 11]), (2, 2, 3)).tolist() == [
        [0, 0, 0], [0, 0, 2], [0, 1, 0], [0, 1, 2], [1, 0, 0], [1, 1, 2]
    ]
    # selecting patches gives the same tokens as the whole-tile convolution
    indices = torch.tensor([7, 0, 11, 4])
    torch.testing.assert_close(embed.forward_at(x, indices)[0, :, 0], tokens[indices])


@pytest.mark.parametrize("kind", ["learned", "sinusoidal"])
def test_position_embedding_of_global_indices(kind):
    model = tiny(pos_embedding=kind)
    table = model.position_embedding(torch.arange(model.num_tokens))
    assert table.shape == (model.num_tokens, 32)
    assert (model.pos_embed.weight is not None) == (kind == "learned")
    indices = torch.tensor([5, 63, 0])
    torch.testing.assert_close(model.position_embedding(indices), table[indices])
    if kind == "sinusoidal":
        assert torch.allclose(table[0, 0::2], torch.zeros(16)) and torch.allclose(table[0, 1::2], torch.ones(16))
    # the encoder is permutation-equivariant once each token carries its global position
    tokens = model.embed(torch.randn(1, 2, 16, 16, 16))
    perm = torch.randperm(model.num_tokens, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model.encode(tokens[:, perm], perm), model.encode(tokens)[:, perm], atol=1e-5, rtol=1e-5)


def test_decoder_follows_figure_2():
    decoder = ConvDecoder(embed_dim=768, num_classes=4, patch=16)
    convs = [m for m in decoder.modules() if isinstance(m, nn.Conv3d)]
    assert [(c.in_channels, c.out_channels, c.kernel_size) for c in convs] == [
        (768, 128, (3, 3, 3)), (128, 64, (3, 3, 3)), (64, 32, (3, 3, 3)), (32, 16, (3, 3, 3)), (16, 4, (1, 1, 1))
    ]
    assert sum(isinstance(m, nn.Upsample) for m in decoder.modules()) == 4
    assert decoder(torch.randn(1, 768, 2, 1, 3)).shape == (1, 4, 32, 16, 48)


def test_paper_defaults():
    model = ViTSeg(in_channels=4, num_classes=3, tile=96)
    assert (len(model.blocks), model.embed_dim, model.heads, model.patch, model.num_tokens) == (12, 768, 12, 16, 216)
    # patch embedding 4*16^3*768 + 768, position table 216*768, 12 blocks of 7,087,872, final norm 2*768,
    # decoder 2,945,283 (768->128->64->32->16 3x3x3 convs with instance-norm affines, 16->3 head)
    assert count_parameters(model) == 12_583_680 + 165_888 + 12 * 7_087_872 + 1_536 + 2_945_283


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"tile": (16, 16, 18)}, r"shape \(16, 16, 18\) must divide by the patch 4 along H, W and D; not along D=18"),
        ({"tile": (16, 16)}, "tile must be a positive int or three positive ints"),
        ({"patch": 6, "tile": 12}, "patch must be a power of two"),
        ({"patch": 0}, "patch must be a positive int"),
        ({"embed_dim": 30}, "embed_dim 30 must be divisible by heads 4"),
        ({"heads": 0}, "heads must be a positive int"),
        ({"layers": 0}, "layers must be a positive int"),
        ({"dropout": 1.0}, r"dropout must lie in \[0, 1\)"),
        ({"mlp_ratio": 0.0}, "mlp_ratio must be positive"),
        ({"pos_embedding": "rotary"}, r"pos_embedding must be one of \('learned', 'sinusoidal'\), got 'rotary'"),
        ({"pos_embedding": "sinusoidal", "embed_dim": 36, "heads": 4, "patch": 4}, None),
        ({"pos_embedding": "sinusoidal", "embed_dim": 33, "heads": 3}, "sinusoidal' needs an even embed_dim"),
        ({"patch": 16, "decoder_features": 4}, "decoder_features 4 must be at least 8"),
        ({"attention_kernel": "flash"}, r"attention_kernel must be one of \('fused', 'math'\), got 'flash'"),
    ],
)
def test_parameter_errors(kwargs, match):
    args = {**TINY, "tile": 16, **kwargs}
    if match is None:
        ViTSeg(**args)
        return
    with pytest.raises(ValueError, match=match):
        ViTSeg(**args)


def saved_bytes(model: ViTSeg, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The output of a training forward and the bytes autograd saves for its backward."""
    saved: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = model(x)
    return out, sum(saved)


def test_the_math_kernel_gives_the_same_logits_and_saves_the_score_matrices():
    """Both kernels compute one function; only the math kernel keeps each layer's (heads, n, n) probabilities."""
    torch.manual_seed(0)
    fused = ViTSeg(2, 3, 16, patch=2, layers=2, embed_dim=16, heads=2, decoder_features=4)
    math_model = ViTSeg(2, 3, 16, patch=2, layers=2, embed_dim=16, heads=2, decoder_features=4,
                        attention_kernel="math")
    math_model.load_state_dict(fused.state_dict())
    assert all(block.attn.core.kernel == "math" for block in math_model.blocks)
    x = torch.randn(1, 2, 16, 16, 16)
    out_fused, bytes_fused = saved_bytes(fused, x)
    out_math, bytes_math = saved_bytes(math_model, x)
    torch.testing.assert_close(out_math, out_fused, rtol=1e-4, atol=1e-5)
    scores = 2 * 2 * 512 * 512 * 4  # layers x heads x n x n fp32, n = 8^3 tokens
    assert bytes_math - bytes_fused >= scores


def test_input_shape_error():
    with pytest.raises(ValueError, match=r"input must be \(B, 2, 16, 16, 16\)"):
        tiny()(torch.randn(1, 2, 16, 16, 8))
    with pytest.raises(ValueError, match="positions must hold one index per token"):
        tiny().encode(torch.randn(1, 4, 32), torch.arange(3))


# --------------------------------------------------------------------------- sliding window


@torch.no_grad()
def test_sliding_window_over_one_tile_is_the_forward_pass():
    from distmis.train.inference import sliding_window

    model = tiny()
    x = torch.randn(2, 2, 16, 16, 16)
    torch.testing.assert_close(sliding_window(model, x, 16, mode="gaussian"), model(x))


# --------------------------------------------------------------------------- axial attention
AXIAL_TILE = (16, 8, 24)  # patch 4: a (4, 2, 6) grid


def axial(**kwargs) -> ViTSeg:
    return tiny(AXIAL_TILE, attention="axial", **kwargs)


def reference_axial_attention(attention, x: torch.Tensor) -> torch.Tensor:
    """What an axial stage computes, line by line with explicit softmax scores (no SDPA, no reshapes to share)."""
    heads, head_dim, axis = attention.heads, attention.head_dim, attention.axis
    q, k, v = attention.qkv(x).chunk(3, dim=-1)
    out = torch.zeros_like(q)
    grid = x.shape[1:4]
    others = [a for a in range(3) if a != axis]
    for i in range(grid[others[0]]):
        for j in range(grid[others[1]]):
            index = [slice(None)] * 3
            index[others[0]], index[others[1]] = i, j
            line = (slice(None), *index)  # (B, g_axis, E): the tokens that share the other two coordinates
            for h in range(heads):
                part = slice(h * head_dim, (h + 1) * head_dim)
                scores = q[line][..., part] @ k[line][..., part].transpose(-1, -2) / head_dim**0.5
                out[line + (part,)] = scores.softmax(-1) @ v[line][..., part]
    return attention.proj(out)


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_an_axial_stage_is_attention_along_the_lines_of_its_axis(axis):
    from distmis.models.vit_seg import AxialSelfAttention

    torch.manual_seed(axis)
    attention = AxialSelfAttention(32, 4, axis).eval()
    x = torch.randn(2, 4, 2, 6, 32)
    torch.testing.assert_close(attention(x), reference_axial_attention(attention, x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_an_axial_stage_sees_only_its_line(axis):
    from distmis.models.vit_seg import AxialSelfAttention

    attention = AxialSelfAttention(32, 4, axis)
    x = torch.randn(1, 4, 2, 6, 32, requires_grad=True)
    attention(x)[0, 1, 1, 3].sum().backward()
    reached = (x.grad[0].abs().sum(-1) > 0).nonzero().tolist()
    line = [[c if a == axis else (1, 1, 3)[a] for a in range(3)] for c in range(x.shape[1 + axis])]
    assert reached == line


def test_one_axial_block_reaches_every_token_of_the_tile():
    """The receptive field: H, then W, then D: after one block every token has a path from every token."""
    model = axial(layers=1)
    tokens = torch.randn(1, model.num_tokens, 32, requires_grad=True)
    probe = torch.randn(32)  # not a plain sum: the features of a LayerNorm's output sum to zero
    (model.encode(tokens)[0, 0] * probe).sum().backward()
    assert (tokens.grad[0].abs().sum(-1) > 0).all()  # a path from every token (no path: exactly zero)
    # without the D stage, the first token is blind to every other D column
    model.blocks[0].axial[2].fn.forward = lambda x: torch.zeros_like(x)
    tokens.grad = None
    (model.encode(tokens)[0, 0] * probe).sum().backward()
    reached = (tokens.grad[0].abs().sum(-1) > 0).reshape(model.grid)
    assert reached[:, :, 0].all() and not reached[:, :, 1:].any()


def test_axial_model_shapes_parameters_and_kernels():
    from distmis.models.vit_seg import AxialTransformerBlock, TransformerBlock
    from distmis.perf.model import ViTShape, vit_parameters

    model = axial()
    full = tiny(AXIAL_TILE)
    assert all(isinstance(b, AxialTransformerBlock) for b in model.blocks)
    assert all(isinstance(b, TransformerBlock) for b in full.blocks)
    # three attention stages (QKV 3E^2 + 3E, projection E^2 + E, norm 2E) where full attention has one
    assert count_parameters(model) - count_parameters(full) == 2 * 2 * (4 * 32 * 32 + 4 * 32 + 2 * 32)
    shape = ViTShape(AXIAL_TILE, 4, 2, 32, 4, 2.0, 16, 2, 3, "axial")
    assert count_parameters(model) == vit_parameters(shape)
    x = torch.randn(2, 2, *AXIAL_TILE)
    out = model(x)
    assert out.shape == (2, 3, *AXIAL_TILE)
    math_kernel = axial(attention_kernel="math")
    torch.testing.assert_close(math_kernel(x), out, atol=1e-5, rtol=1e-5)
    # the stream between stages is the token grid; encode returns row-major tokens
    assert model.encode(model.embed(x)).shape == (2, model.num_tokens, 32)


def test_axial_encode_needs_the_grid_of_a_sub_box():
    model = axial()
    tokens = model.embed(torch.randn(1, 2, 8, 8, 24))  # the first half along H: a (2, 2, 6) box
    positions = torch.arange(24)
    assert model.encode(tokens, positions, (2, 2, 6)).shape == (1, 24, 32)
    with pytest.raises(ValueError, match=r"axial attention needs the grid box the 24 tokens fill; grid \(4, 2, 6\)"):
        model.encode(tokens, positions)


def test_axial_attention_cores_are_swappable_from_outside():
    from distmis.models.vit_seg import AxialSelfAttention

    model = axial()
    calls = []

    class Recording(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, q, k, v):
            calls.append((self.inner.axis, tuple(q.shape)))
            return self.inner(q, k, v)

    for module in model.modules():
        if isinstance(module, AxialSelfAttention):
            module.core = Recording(module.core)
    model(torch.randn(1, 2, *AXIAL_TILE))
    assert calls == [(axis, (1, 4, 4, 2, 6, 8)) for _ in range(2) for axis in (0, 1, 2)]


def test_axial_attention_errors():
    with pytest.raises(ValueError, match=r"attention must be one of \('full', 'axial'\), got 'ring'"):
        tiny(AXIAL_TILE, attention="ring")
