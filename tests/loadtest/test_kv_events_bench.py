"""``python -m loadtest.bench.kv_events`` runs and prints its figures (small sizes)."""

from loadtest.bench.kv_events import block_manager_time, main, _stream


def test_prints_the_figures(capsys):
    assert main(["--requests", "40", "--prefix", "64", "--tail", "8", "--block-size", "4", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "events off" in out and "events on" in out and "BlockStored of 18 blocks" in out and "bytes" in out


def test_events_are_made_only_when_on_and_the_pool_evicts():
    prompts = _stream(40, 64, 8)
    assert block_manager_time(prompts, 4, False)[1] == {"Stored": 0, "Removed": 0, "Cleared": 0}
    counts = block_manager_time(prompts, 4, True)[1]
    assert counts["Stored"] >= 40 and counts["Removed"] > 0
