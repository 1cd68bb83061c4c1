"""KV offload tiers end to end in the offline engine (a tiny random Llama, a tiny pool that forces
evictions): greedy outputs equal transformers' with blocks evicted to the host tier and to files
and brought back; a new engine on the same directory (a restart) finds the blocks, reports the
prompt's tokens cached and answers the same; a corrupt, truncated or foreign file is logged and
never served; the disk bound holds; a directory that cannot be written is a one-line error."""

import os
import shutil

import pytest
import structlog
import torch

from services.executor.kv_files import BlockFiles
from services.scheduler.block_manager import BlockManager
from tests.doubles.engine import InProcessEngine, hf_greedy, tiny_llama

BS = 4
MAX_NEW = 5


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=5)


def _prompts(seed: int, num: int, length: int = 40) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 128, (length,), generator=gen).tolist() for _ in range(num)]


SHARED = _prompts(1, 1)[0]
ASKED = [SHARED + tail for tail in _prompts(2, 4, 3)]  # four questions about one document
FLOOD = _prompts(3, 4)  # unrelated prompts that push the document's blocks out of the pool


@pytest.fixture(scope="module")
def reference(model):
    return {tuple(p): hf_greedy(model, p, MAX_NEW) for p in ASKED + FLOOD}


def _engine(model, **options):
    return InProcessEngine(model, num_blocks=24, block_size=BS, max_num_seqs=2, **options)


def _ask(engine, prompts, reference, tag):
    """Run ``prompts`` one after another; check each against transformers; their cached tokens."""
    cached = []
    for i, p in enumerate(prompts):
        engine.add(f"{tag}{i}", p, temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        assert engine.run()[f"{tag}{i}"] == reference[tuple(p)]
        cached.append(engine.outputs[f"{tag}{i}"][-1].num_cached_tokens)
    return cached


def _rounds(engine, reference):
    """The document, the flood, the document again: its second asking finds its blocks in a tier."""
    _ask(engine, ASKED[:2], reference, "a")
    _ask(engine, FLOOD, reference, "f")
    return _ask(engine, ASKED[2:], reference, "b")


@pytest.mark.parametrize("tiers", ["host", "disk", "disk-async"])
def test_outputs_equal_transformers_after_evictions_and_reloads(model, reference, tiers, tmp_path):
    plain = _rounds(_engine(model), reference)
    options = {"num_host_offload_blocks": 48} if tiers == "host" else {
        "num_host_offload_blocks": 4, "kv_offload_dir": str(tmp_path), "async_scheduling": tiers == "disk-async"}
    engine = _engine(model, **options)
    tiered = _rounds(engine, reference)
    counts = engine.blocks.tiers.counts
    assert counts["offloaded"] > 0 and counts["reloaded"] > 0
    if tiers != "host":
        assert counts["spilled"] > 0 and counts["loaded"] > 0
    assert plain[0] < len(SHARED)  # without tiers the flood took some of the document's blocks
    assert tiered[0] == len(SHARED)  # with them every full block came back (from disk: in rounds of 4)


def _stored_engine(model, reference, directory):
    """An engine that leaves the document's blocks in files, the way a server stops."""
    engine = _engine(model, num_host_offload_blocks=4, kv_offload_dir=str(directory))
    _rounds(engine, reference)
    _ask(engine, FLOOD, reference, "g")  # the document leaves the host tier too
    engine.runner.offload.flush()
    return engine


def _document_keys(num: int) -> list[bytes]:
    return BlockManager(1, BS).prefix_hashes(SHARED, num)


@pytest.fixture(scope="module")
def stored_dir(model, reference, tmp_path_factory):
    directory = tmp_path_factory.mktemp("kv")
    files = _stored_engine(model, reference, directory).runner.offload.files
    assert all(files.path(k).exists() for k in _document_keys(len(SHARED) // BS))
    return directory


def test_a_restarted_engine_finds_the_blocks_and_answers_the_same(model, reference, stored_dir, tmp_path):
    directory = tmp_path / "copy"
    shutil.copytree(stored_dir, directory)
    engine = _engine(model, num_host_offload_blocks=16, kv_offload_dir=str(directory))  # the document fits
    assert len(engine.runner.offload.startup_keys) >= len(SHARED) // BS
    [cached] = _ask(engine, ASKED[3:], reference, "r")
    assert cached == len(SHARED)  # every full block of the document, none computed
    assert engine.blocks.num_hit_tokens >= len(SHARED)  # what /metrics' prefix-cache counters read


def _foreign_file(key: bytes, payload_bytes: int, tmp_path) -> bytes:
    other = BlockFiles(tmp_path / "other", {"model": "another"})
    other.write(key, bytes(payload_bytes))
    return other.path(key).read_bytes()


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "foreign"])
def test_a_damaged_file_is_logged_and_never_served(model, reference, stored_dir, tmp_path, damage):
    directory = tmp_path / "copy"
    shutil.copytree(stored_dir, directory)
    [digest] = [d for d in os.listdir(directory)]
    bad = 3  # the document's fourth block: the three before it still count
    path = directory / digest / (_document_keys(bad + 1)[bad].hex() + ".kv")
    data = bytearray(path.read_bytes())
    if damage == "corrupt":
        data[-7] ^= 0x40
    elif damage == "truncated":
        data = data[: len(data) // 2]
    else:
        data = bytearray(_foreign_file(_document_keys(bad + 1)[bad], len(data) - 80, tmp_path))
    path.write_bytes(bytes(data))
    with structlog.testing.capture_logs() as logs:
        engine = _engine(model, num_host_offload_blocks=16, kv_offload_dir=str(directory))
        [cached] = _ask(engine, ASKED[3:], reference, "d")  # still transformers' answer
    assert cached == bad * BS
    if damage == "truncated":  # seen at start by its size: never listed
        [event] = [e for e in logs if e["event"] == "kv offload directory"]
        assert path.name in event["ignored_names"]
    else:  # seen when read: its checksum or its header
        [event] = [e for e in logs if e["event"] == "kv offload file not served"]
        assert event["key"] == path.stem and damage in event["reason"]
        assert engine.blocks.tiers.counts["load_failed"] == 1 and not path.exists()


def test_the_disk_bound_holds(model, reference, tmp_path):
    num_files = 6
    payload = 2 * 2 * 2 * BS * 16 * 4  # layers x (keys, values) x kv heads x slots x head dim x float32
    size_gib = num_files * (80 + payload) / 2**30
    engine = _engine(model, num_host_offload_blocks=2, kv_offload_dir=str(tmp_path), kv_offload_disk_size=size_gib)
    assert engine.blocks.tiers.num_disk_blocks == num_files
    _rounds(engine, reference)
    engine.runner.offload.flush()
    files = [n for n in os.listdir(engine.runner.offload.files.dir) if n.endswith(".kv")]
    assert engine.blocks.tiers.counts["deleted"] > 0  # the bound was reached
    assert 0 < len(files) <= num_files


def test_a_directory_that_cannot_be_written_is_a_one_line_error(model, tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match="--kv-offload-dir .*not a writable directory"):
        _engine(model, num_host_offload_blocks=4, kv_offload_dir=str(tmp_path / "a-file" / "kv"))


def test_eight_bit_kv_pools_are_refused_with_the_tiers_in_one_line():
    from services.executor.loader import RunnerOptions

    with pytest.raises(ValueError, match="do not take --kv-cache-dtype int8 yet"):
        RunnerOptions(kv_offload_memory=0.01, kv_cache_dtype="int8")
    assert RunnerOptions(kv_offload_memory=0.01).kv_cache_dtype == "auto"
