"""LiveBytes counts the storages a piece of torch code makes, from their creation to their release."""

import torch

from distmis.estimate.live_bytes import LiveBytes

MIB = 2**20


def test_new_storages_count_until_freed_and_views_and_held_tensors_do_not():
    held = torch.zeros(MIB // 4)  # 1 MiB, there before
    live = LiveBytes()
    live.hold([held])
    with live:
        a = torch.ones(MIB // 2)  # 2 MiB
        view = a[: MIB // 4].view(-1, 2)  # a view: nothing new
        b = held.view(-1, 4).t()  # a view of a held tensor: nothing new
        c = a * 2  # 2 MiB
        assert live.mark() == 4 * MIB
        del c
        assert live.mark() == 2 * MIB
        d = torch.empty(3 * MIB, dtype=torch.uint8)
        del a, view
        assert live.mark() == 3 * MIB
    assert live.peak == 5 * MIB
    assert "mul" in live.moment or "empty" in live.moment
    del b, d


def test_an_operations_workspace_is_added_at_its_moment_only():
    def workspace(func, args, out):
        return 10 * MIB if func is torch.ops.aten.mm.default else 0

    x = torch.ones(64, 64)
    with LiveBytes(workspace) as live:
        y = torch.ones(MIB // 4)  # 1 MiB
        z = x @ x  # 16 KiB and the 10 MiB workspace while it runs
        del y
        w = torch.ones(MIB // 2)  # 2 MiB: more live bytes than at the product, less than with its workspace
    assert live.peak == MIB + z.untyped_storage().nbytes() + 10 * MIB
    assert live.peak_workspace == 10 * MIB
    assert live.moment == "aten.mm.default"
    del w
