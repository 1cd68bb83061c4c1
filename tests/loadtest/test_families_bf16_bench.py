"""``python -m loadtest.bench.families_bf16`` runs and prints one row per family (small sizes)."""

from loadtest.bench.families_bf16 import main


def test_prints_a_row_per_family(capsys):
    main(["--families", "qwen3,gemma2", "--prompts", "1", "--tokens", "4"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "%" in line]
    assert [r.split("|")[1].strip() for r in rows] == ["qwen3", "gemma2"]
    for r in rows:
        greedy, forced = (float(c.strip().rstrip("%")) for c in r.split("|")[2:4])
        assert 0 <= greedy <= 100 and 0 <= forced <= 100
