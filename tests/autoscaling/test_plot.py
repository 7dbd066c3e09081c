"""`pdfleet sim --plot`: a real picture of the run."""

from __future__ import annotations

from helpers.pictures import assert_picture

from pdfleet.engine.cli import main


def test_sim_plot_writes_a_picture_of_rate_replicas_and_ttft(tmp_path, capsys):
    out = tmp_path / "sim.png"
    argv = ["sim", "--regime", "cpu", "--duration", "900", "--rate", "4", "--burst-every", "400"]
    argv += ["--plot", str(out)]
    assert main(argv) == 0
    assert "pdfleet" in capsys.readouterr().out
    assert_picture(out, (720, 680))


def test_sim_plot_refuses_several_seeds_with_a_clear_error(tmp_path, capsys):
    argv = ["sim", "--seeds", "2", "--plot", str(tmp_path / "x.png")]
    assert main(argv) == 2
    assert "--plot draws one run" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
