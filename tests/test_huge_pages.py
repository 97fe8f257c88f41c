"""The CPU's large weights in transparent huge pages (model_loader/huge_pages.py): where
they are placed, that each keeps a storage of its own, that a replaced weight's pages
go back to the system, that the rest become huge pages without touching those, and that
a real load puts its weights there."""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from engine.arg_utils import create_engine_config
from engine.tiny_model import make_tiny_model
from model_loader import get_model
from model_loader.huge_pages import HUGE_PAGE, MIN_BYTES, place_in_huge_pages, transparent_huge_pages

pytestmark = pytest.mark.skipif(sys.platform != "linux" or transparent_huge_pages() is None,
                                reason="needs Linux with transparent huge pages (`always` or `madvise`)")


def vma_of(address: int) -> dict[str, int | str]:
    """The /proc/self/smaps entry of the mapping holding `address`: its bounds, `Rss` and
    `AnonHugePages` in bytes, and `VmFlags` (where `hg` marks MADV_HUGEPAGE)."""
    entry: dict[str, int | str] | None = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                if entry is not None and entry["start"] <= address < entry["end"]:
                    return entry
                lo, hi = (int(x, 16) for x in head.split("-"))
                entry = {"start": lo, "end": hi}
            elif entry is not None and head in ("Rss:", "AnonHugePages:"):
                entry[head[:-1]] = int(line.split()[1]) * 1024
            elif entry is not None and head == "VmFlags:":
                entry["VmFlags"] = line.split(":", 1)[1]
    assert entry is not None and entry["start"] <= address < entry["end"], hex(address)
    return entry


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Parameter(torch.empty(1024, 1024), requires_grad=False)  # 4 MiB
        self.odd = nn.Parameter(torch.empty(777, 1001), requires_grad=False)  # 3.1 MB, not a page multiple
        self.small = nn.Parameter(torch.ones(1000), requires_grad=False)
        self.register_buffer("table", torch.empty(600, 1024, dtype=torch.bfloat16))  # 1.2 MB: left alone
        self.register_buffer("cache", torch.empty(2048, 1024, dtype=torch.float16))  # 4 MiB buffer


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = Block(), Block()
        self.head = nn.Linear(1024, 1024, bias=False)
        self.head.weight = self.a.big  # tied: one slice, two holders


def test_large_parameters_and_buffers_get_slices_of_one_mapping() -> None:
    model = Model()
    small_before = model.a.small.data_ptr()
    arena = place_in_huge_pages(model)
    assert arena is not None
    placed = [model.a.big, model.a.odd, model.a.cache, model.b.big, model.b.odd, model.b.cache]
    assert model.head.weight is model.a.big
    assert arena.nbytes == sum(t.numel() * t.element_size() for t in placed)
    mapping = vma_of(arena.base)
    for t in placed:
        assert mapping["start"] <= t.data_ptr() < mapping["end"]
        assert t.data_ptr() % 64 == 0
        # Each its own storage: checks by storage (safetensors' shared-memory check,
        # sleep mode) see one tensor per storage, as before.
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    assert len({t.untyped_storage().data_ptr() for t in placed}) == len(placed)
    assert (arena.base + arena.slices[0].start) % HUGE_PAGE == 0
    assert model.a.small.data_ptr() == small_before  # under MIN_BYTES: untouched
    assert model.a.table.numel() * model.a.table.element_size() < MIN_BYTES
    assert not mapping["start"] <= model.a.table.data_ptr() < mapping["end"]
    assert isinstance(model.a.big, nn.Parameter) and model.a.big.dtype == torch.float32
    assert model.a.cache.dtype == torch.float16 and model.a.cache.shape == (2048, 1024)


def test_written_weights_become_huge_pages_and_outlive_the_arena() -> None:
    model = Model()
    arena = place_in_huge_pages(model)
    assert arena is not None
    base = arena.base
    with torch.no_grad():
        for block in (model.a, model.b):
            block.big.copy_(torch.arange(1024 * 1024, dtype=torch.float32).view(1024, 1024))
            block.odd.fill_(3.0)
            block.cache.fill_(1.5)
    # The slices are adjacent: one run, its whole 2 MB pages (the last slice ends mid-page).
    total = sum(p.nbytes for p in arena.slices)
    assert arena.huge_page_ranges() == [(arena.slices[0].start, arena.slices[0].start + total // HUGE_PAGE * HUGE_PAGE)]
    done = arena.collapse_in_background()
    done.join(timeout=60)
    assert not done.is_alive()
    huge = vma_of(base).get("AnonHugePages", 0)
    if huge == 0:
        pytest.skip("the kernel made no huge page (no MADV_COLLAPSE before Linux 6.1, or none free)")
    assert huge <= total // HUGE_PAGE * HUGE_PAGE
    del arena  # the slices' storages keep the mapping alive
    torch.testing.assert_close(model.head(torch.eye(1024)[:2]), model.a.big[:, :2].t().contiguous())
    assert float(model.b.odd.sum()) == 3.0 * 777 * 1001
    assert float(model.a.cache.float().sum()) == 1.5 * 2048 * 1024
    assert vma_of(base)["Rss"] >= 6 * 3 * 2**20


def test_replaced_weights_give_their_pages_back() -> None:
    model = Model()
    arena = place_in_huge_pages(model)
    assert arena is not None
    with torch.no_grad():
        for t in (model.a.big, model.a.odd, model.a.cache, model.b.big, model.b.odd, model.b.cache):
            t.fill_(1.0)
    resident = vma_of(arena.base)["Rss"]
    placed_slices = list(arena.slices)
    assert arena.release_unused() == 0  # nothing replaced yet
    # A loader aliasing a checkpoint (new data, same Parameter), a repacking method (a new
    # Parameter object in the module), and one holder of the tied weight replaced.
    model.b.odd.data = torch.zeros(777, 1001)
    model.b.big = nn.Parameter(torch.zeros(1024, 1024), requires_grad=False)
    model.head.weight = nn.Parameter(torch.zeros(1024, 1024), requires_grad=False)
    released = arena.release_unused()
    odd = 777 * 1001 * 4
    # The replaced slices' whole pages: all of b.big, b.odd less at most two pages.
    assert 4 * 2**20 + odd - 2 * 4096 <= released <= 4 * 2**20 + odd
    assert vma_of(arena.base)["Rss"] <= resident - released + 2 * 4096
    # a.big is still read by model.a: kept, and its values with it.
    assert float(model.a.big.sum()) == 1024 * 1024
    assert float(model.b.cache.float().sum()) == 2048 * 1024
    assert len(arena.slices) == 4
    assert arena.release_unused() == 0
    # A collapse makes huge only whole 2 MB pages of the slices still read: the released
    # ones stay released.
    released_spans = [(p.start, p.start + p.nbytes) for p in placed_slices if p not in arena.slices]
    assert len(released_spans) == 2
    for lo, hi in arena.huge_page_ranges():
        assert lo % HUGE_PAGE == (-arena.base) % HUGE_PAGE and (hi - lo) % HUGE_PAGE == 0
        assert all(hi <= start or lo >= stop for start, stop in released_spans)
    before = vma_of(arena.base)["Rss"]
    arena.collapse()
    assert vma_of(arena.base)["Rss"] <= before


def test_placing_needs_no_large_tensor() -> None:
    assert place_in_huge_pages(nn.Linear(8, 8)) is None


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_loaded_model_holds_its_large_weights_in_huge_pages(tmp_path, dtype: str) -> None:
    """Through the loader: the large weights it copied (the fused gate/up ones; at TP=1 the
    checkpoint's whole tensors are views of its file) are slices of one mapping, made huge
    in the background, and hold the checkpoint's values. 16-bit weights: the CPU's kernels
    read them where they were loaded (float32 ones are packed anew)."""
    model_dir = make_tiny_model(tmp_path / "m", "llama", seed=5, dtype=dtype, hidden_size=512,
                                intermediate_size=1536, num_hidden_layers=2, num_attention_heads=8,
                                num_key_value_heads=2, vocab_size=2048, with_tokenizer=False)
    config = create_engine_config(model=str(model_dir), device="cpu", dtype=dtype, use_tqdm_on_load=False)
    model = get_model(config)
    for thread in threading.enumerate():  # the load's collapse, done in the background
        if thread.name == "huge-pages":
            thread.join(timeout=60)
    fused = [p for name, p in model.named_parameters() if name.endswith("gate_up_proj.weight")]
    assert len(fused) == 2 and all(p.numel() * p.element_size() >= MIN_BYTES for p in fused)
    arena = vma_of(fused[0].data_ptr())
    for p in fused:  # slices of one mapping, each its own storage
        assert arena["start"] <= p.data_ptr() < arena["end"]
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size()
    if arena.get("AnonHugePages", 0) == 0:
        pytest.skip("the kernel made no huge page (no MADV_COLLAPSE before Linux 6.1, or none free)")
    # The slices hold the checkpoint's values (fused gate/up: the two, stacked).
    files = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        files.update(load_file(f))
    for i in range(2):
        prefix = f"model.layers.{i}.mlp."
        torch.testing.assert_close(model.get_parameter(prefix + "gate_up_proj.weight"),
                                   torch.cat([files[prefix + "gate_proj.weight"], files[prefix + "up_proj.weight"]]),
                                   rtol=0, atol=0)
        torch.testing.assert_close(model.get_parameter(prefix + "down_proj.weight"), files[prefix + "down_proj.weight"],
                                   rtol=0, atol=0)
    torch.testing.assert_close(model.get_parameter("model.embed_tokens.weight"), files["model.embed_tokens.weight"],
                               rtol=0, atol=0)
