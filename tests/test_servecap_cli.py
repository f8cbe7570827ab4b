"""The one console script, `servecap COMMAND ...`: each package's command line, the simulator's without torch."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_servecap_runs_each_packages_command_line_and_refuses_an_unknown_one(capsys):
    from servecap.cli import main
    assert main(["sim", "run", "--rate", "5", "--n", "20"]) == 0
    assert "served" in capsys.readouterr().out
    assert main(["nope"]) == 2
    assert "unknown command 'nope'" in capsys.readouterr().err
    assert main([]) == 0 and "commands:" in capsys.readouterr().out


def test_servecap_sim_imports_no_torch():
    code = ("import sys; from servecap.cli import main; main(['sim', 'run', '--rate', '5', '--n', '10']); "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True).returncode == 0
