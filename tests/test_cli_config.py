"""`maskc config --from-hf` / `--from-maxtext`: the YAML loads back to the same config."""

from __future__ import annotations

import json

import pytest

import maskc
from maskc.cli import commands as cli
from maskc.cli.config import to_yaml
from maskc.config import from_hf, from_maxtext

yaml = pytest.importorskip("yaml")


def run(capsys, *argv):
  code = cli.main(list(argv))
  out, err = capsys.readouterr()
  return code, out, err


HF = [
    {"model_type": "gemma3", "text_config": {"num_hidden_layers": 12, "sliding_window": 1024}},
    {"model_type": "llama4_text", "num_hidden_layers": 8, "attention_chunk_size": 8192},
    {"model_type": "qwen2", "num_hidden_layers": 4, "use_sliding_window": True,
     "max_window_layers": 2, "sliding_window": 512},
    {"model_type": "modernbert", "num_hidden_layers": 6},
    {"model_type": "gemma2", "num_hidden_layers": 3, "layer_types": [
        "full_attention", "full_attention", "sliding_attention"]},
]


@pytest.mark.parametrize("config", HF)
@pytest.mark.parametrize("flags", [[], ["--no-padding", "--no-packing"]])
def test_from_hf_prints_yaml_that_loads_back(tmp_path, capsys, config, flags):
  path = tmp_path / "config.json"
  path.write_text(json.dumps(config))
  code, out, err = run(capsys, "config", "--from-hf", str(path), *flags)
  assert code == 0 and err == ""
  assert out.startswith("# The attention masks of")
  printed = tmp_path / "masks.yaml"
  printed.write_text(out)
  expected = from_hf(config, padding="--no-padding" not in flags,
                     packing="--no-packing" not in flags)
  assert maskc.load_config(str(printed)) == expected


def test_from_maxtext_prints_yaml_that_loads_back(tmp_path, capsys):
  config = {"decoder_block": "llama4", "base_num_decoder_layers": 8, "nope_layer_interval": 4,
            "chunk_attn_window_size": 8192, "ici_context_parallelism": 4}
  path = tmp_path / "llama4.yml"
  path.write_text(yaml.safe_dump(config))
  for flags, kw in (([], {}), (["--path", "dot_product", "--no-segments"],
                               {"path": "dot_product", "segments": False})):
    code, out, _ = run(capsys, "config", "--from-maxtext", str(path), *flags)
    assert code == 0
    loaded = maskc.load_config(yaml.safe_load(out))
    assert loaded == from_maxtext(config, **kw)
    assert loaded.context_parallel.layout == "zigzag"


def test_errors_exit_1_naming_the_field(tmp_path, capsys):
  path = tmp_path / "config.json"
  path.write_text(json.dumps({"model_type": "falcon"}))
  code, out, err = run(capsys, "config", "--from-hf", str(path))
  assert code == 1 and out == "" and "model_type" in err and "falcon" in err
  code, _, err = run(capsys, "config", "--from-hf", str(tmp_path / "missing.json"))
  assert code == 1 and "missing.json" in err


def test_one_source_is_required(capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["config"])
  assert e.value.code == 2
  capsys.readouterr()


def test_yaml_quotes_what_yaml_would_read_itself():
  data = {"a": "| causal", "b": "true", "c": ["x", "& y", None, 3, False], "d": {"e": "f g"},
          "layers": ["causal", {"heads": ["causal", "sliding(4)"]}], "odd key": 1}
  assert yaml.safe_load(to_yaml(data)) == data
