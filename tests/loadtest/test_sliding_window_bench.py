"""``python -m loadtest.memory.sliding_window`` runs and prints its three figures (small sizes)."""

from loadtest.memory.sliding_window import main, max_blocks_one_sequence, sequences_that_fit


def test_prints_the_figures(capsys):
    assert main(["--window", "32", "--block-size", "4", "--num-blocks", "64", "--num-seqs", "4"]) == 0
    out = capsys.readouterr().out
    assert "most blocks one sequence holds" in out and "window freeing off" in out and "preemptions" in out


def test_the_window_holds_fewer_blocks_and_fits_more_sequences():
    assert max_blocks_one_sequence(32, 4, 128) == 9 < max_blocks_one_sequence(0, 4, 128) == 32
    assert sequences_that_fit(256, 16, 512, 1024) > sequences_that_fit(0, 16, 512, 1024) == 8
