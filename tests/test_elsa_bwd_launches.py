"""scripts/elsa_bwd_launches.py's argument handling (its timing needs a GPU): bad input is one line and exit 2."""
import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "elsa_bwd_launches.py"


def _load():
    spec = importlib.util.spec_from_file_location("elsa_bwd_launches", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bad_dtype_is_one_line(tmp_path, capsys):
    assert _load().main([str(tmp_path / "out.json"), "--dtypes", "float16,float17"]) == 2
    err = capsys.readouterr().err
    assert err == "elsa_bwd_launches: --dtypes: 'float17' is not float16, bfloat16 or float32\n"
    assert not (tmp_path / "out.json").exists()
