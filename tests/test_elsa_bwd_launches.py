"""scripts/elsa_bwd_launches.py's argument handling (its timing needs a GPU): bad input is one line and exit 2."""
from scripts_loader import load_script


def test_bad_dtype_is_one_line(tmp_path, capsys):
    assert load_script("elsa_bwd_launches").main([str(tmp_path / "out.json"), "--dtypes", "float16,float17"]) == 2
    err = capsys.readouterr().err
    assert err == "elsa_bwd_launches: --dtypes: 'float17' is not float16, bfloat16 or float32\n"
    assert not (tmp_path / "out.json").exists()
