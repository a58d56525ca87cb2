"""What the stages share: the spec error, the type tests of settings, the device resolver."""

from __future__ import annotations

import math

import pytest
import torch

from lrattnres.checks import is_int, is_number
from lrattnres.devices import resolve_device
from lrattnres.errors import SpecError, UserError


def test_type_tests_refuse_bools_and_non_finite_numbers():
    assert is_int(3) and is_int(0) and not is_int(True) and not is_int(3.0) and not is_int("3")
    assert is_number(2.5) and is_number(-1) and not is_number(False) and not is_number(math.nan)
    assert not is_number(math.inf) and not is_number("1") and not is_number(None)


def test_every_stage_raises_the_one_spec_error():
    from lrattnres import convert
    from lrattnres.throughput import spec as throughput_spec
    from lrattnres.data import spec as data_spec
    from lrattnres.evaluate import cli as evaluate_cli
    from lrattnres.train import spec as train_spec

    assert issubclass(SpecError, UserError) and issubclass(SpecError, ValueError)
    for module in (data_spec, train_spec, evaluate_cli, throughput_spec):
        assert module.SpecError is SpecError
    with pytest.raises(SpecError, match=r"spec\.batch_size: missing"):
        convert.validate_spec({"rank": 4})


def test_the_device_resolver_names_the_setting():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(SpecError, match=r"throughput spec key 'device': expected auto, cpu, cuda or cuda:N, got 'gpu'"):
        resolve_device("gpu", where="throughput spec key 'device'")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=r"diagnostics\.device: 'cuda:1' asked for, but no CUDA device"):
            resolve_device("cuda:1", where="diagnostics.device", error=RuntimeError)
