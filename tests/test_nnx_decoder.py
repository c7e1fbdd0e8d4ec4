"""examples/nnx_decoder.py: the Flax decoder built from a mask config trains, and decoding
with the KV cache gives the logits of a full forward pass over the generated text.

The default run checks the decode law at the initial weights on the Llama 4 config;
`make test-slow` runs the example as a user does, on both configs, and checks that the
model learned its toy language and generates it.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import jax
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("yaml")

import maskc  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _example():
  spec = importlib.util.spec_from_file_location("nnx_decoder",
                                                ROOT / "examples" / "nnx_decoder.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up while it loads
  spec.loader.exec_module(module)
  return module


def test_decoding_with_the_cache_equals_the_full_forward():
  """Ring caches (the chunked layers), per-head masks and packed documents in the prompt, at
  the initial weights (training runs in the slow tests)."""
  result = _example().run("llama4", steps=0, batch=2, length=32, prompt=24, generate=4)
  assert result.windows == [16, 16, 16, None]
  assert result.decode_error < 1e-4
  assert result.generated.shape == (2, 4)


def test_the_data_follows_the_config_operands():
  example = _example()
  rng = np.random.default_rng(1)
  for name, operand in (("gemma3", "img"), ("llama4", "seg")):
    cfg = example.ModelConfig(masks=maskc.load_config(example.CONFIGS[name]))
    data = example.make_batch(rng, cfg, 4, 48)
    assert set(data.operands) == {operand} and data.tokens.shape == (4, 48)
    # Every counted target is the progression's next token: the previous text token of
    # its document plus the row's step, skipping image tokens.
    for b in range(4):
      ops = data.operands[operand]
      text = ~ops[b] if operand == "img" else np.ones(48, bool)
      doc = ops[b] if operand == "seg" else np.zeros(48, int)
      for i in np.flatnonzero(data.weights[b]):
        before = [j for j in range(i) if text[j] and doc[j] == doc[i]]
        step = (data.tokens[b, i] - data.tokens[b, before[-1]]) % cfg.vocab
        assert step == (data.tokens[b, before[-1]] - data.tokens[b, before[-2]]) % cfg.vocab
        assert 1 <= step <= 3


@pytest.mark.slow
@pytest.mark.parametrize("config", ["gemma3", "llama4"])
def test_the_example_learns_and_generates(config):
  result = _example().run(config)
  assert result.losses[-1] < 0.5 * result.losses[0]
  assert result.accuracy >= 0.9
  assert result.decode_error < 1e-4


@pytest.mark.slow
def test_block_sparse_gradients_match_dense_through_the_model():
  """Through the whole decoder, the XLA block-sparse backend gives the dense backend's loss
  and gradients."""
  from flax import nnx
  example = _example()
  masks = maskc.load_config(example.CONFIGS["gemma3"])
  data = example.make_batch(np.random.default_rng(0), example.ModelConfig(masks=masks), 2, 64)
  results = []
  for backend in ("xla", "dense"):
    model = example.Decoder(example.ModelConfig(masks=masks, backend=backend),
                            rngs=nnx.Rngs(0))
    results.append(nnx.value_and_grad(example.loss_fn)(model, data.tokens, data.operands,
                                                       data.weights))
  (loss, grads), (loss_ref, grads_ref) = results
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-5)
  for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(grads_ref)):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("config, needles", [
    ("llama3", ["unknown config 'llama3'", "Did you mean `llama4`?",
                "The configs are gemma3, llama4"]),
    ("missing.yaml", ["cannot read the config file"]),
])
def test_an_unknown_config_is_a_clear_error(capsys, monkeypatch, config, needles):
  monkeypatch.setattr(sys, "argv", ["nnx_decoder.py", "--config", config, "--steps", "0"])
  with pytest.raises(SystemExit) as info:
    _example().main()
  err = capsys.readouterr().err
  assert info.value.code == 1 and err.startswith("nnx_decoder.py: error: ")
  assert all(n in err for n in needles), err
  assert "Traceback" not in err
