"""The run log: what a quiet run prints."""

from redcoast.logs import RunLogger


def test_a_quiet_run_says_each_warning_once(capsys):
    # quiet and without a workdir the run's logger has no handler, and Python's last-resort
    # handler printed every warning a second time beside the quiet-mode line
    RunLogger(verbose=False).warning("every device repeats the same work")
    captured = capsys.readouterr()
    assert (captured.out + captured.err).count("every device repeats the same work") == 1
    assert "[redcoast] WARNING: every device repeats the same work" in captured.err
