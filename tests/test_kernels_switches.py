"""The kernel switches: one `KernelConfig` in force for the process, put there by `use_kernels`
(the engine's call when it is built), the only moment the environment overrides are read;
`reference_ops` forces the references over it."""

import types

import pytest
import torch
from conftest import make_target

from blockspec import LLM
from blockspec.config import EngineConfig, KernelConfig
from blockspec.layers import fast_path
from blockspec.layers.fast_path import ENV_OVERRIDES, active_kernels, reference_ops, use_kernels
from blockspec.layers.kernels import kernel_module, pdl
from blockspec.layers.linear import fused_gemms_on

CUDA_DEVICE = torch.device("cuda")  # a device object only: nothing runs on it
ON_CUDA = types.SimpleNamespace(is_cuda=True)  # what `fast_path` asks of a tensor


@pytest.fixture(autouse=True)
def restored_switches(monkeypatch):
    """Each test leaves the process's switches as it found them, and starts without overrides."""
    monkeypatch.setattr(fast_path, "_kernels", KernelConfig())  # whatever an earlier test put in force
    for name in ENV_OVERRIDES.values():
        monkeypatch.delenv(name, raising=False)


def test_engine_config_holds_the_defaults():
    assert EngineConfig().kernels == KernelConfig() == KernelConfig(triton_linear=True, pdl=True, fp8_kernel=True)
    assert active_kernels() == KernelConfig()


def test_use_kernels_puts_the_config_in_force():
    off = KernelConfig(triton_linear=False, pdl=False, fp8_kernel=False)
    assert use_kernels(off) == off and active_kernels() == off
    assert not fused_gemms_on(CUDA_DEVICE)
    assert pdl.pdl_launch(CUDA_DEVICE) == {"PDL": False}
    assert use_kernels(KernelConfig()) == KernelConfig()
    assert fused_gemms_on(CUDA_DEVICE) is (kernel_module("skinny_linear") is not None)


def test_environment_overrides_apply_when_the_engine_switches(monkeypatch):
    monkeypatch.setenv("BLOCKSPEC_TRITON_LINEAR", "0")
    monkeypatch.setenv("BLOCKSPEC_FP8_KERNEL", "off")
    assert active_kernels() == KernelConfig()  # set, not yet read
    assert not fused_gemms_on(torch.device("cpu"))
    if kernel_module("skinny_linear") is not None:
        assert fused_gemms_on(CUDA_DEVICE)
    applied = use_kernels(KernelConfig(pdl=False))
    assert applied == KernelConfig(triton_linear=False, pdl=False, fp8_kernel=False) == active_kernels()
    assert not fused_gemms_on(CUDA_DEVICE)
    monkeypatch.setenv("BLOCKSPEC_TRITON_LINEAR", "1")  # changed after the engine was built: no effect
    assert not active_kernels().triton_linear
    monkeypatch.setenv("BLOCKSPEC_PDL", "1")  # an override turns a switch on as well as off
    assert use_kernels(KernelConfig(pdl=False)) == KernelConfig(fp8_kernel=False)


def test_environment_override_must_be_a_switch(monkeypatch):
    monkeypatch.setenv("BLOCKSPEC_PDL", "sometimes")
    with pytest.raises(ValueError, match="BLOCKSPEC_PDL"):
        use_kernels(KernelConfig())
    assert active_kernels() == KernelConfig()


def test_reference_ops_forces_the_reference_over_the_switches():
    with torch.no_grad():
        assert fast_path.fast_path(ON_CUDA)
        with reference_ops():
            assert not fast_path.fast_path(ON_CUDA) and fast_path.fast_kernels(ON_CUDA, "argmax") is None
            with reference_ops():
                pass
            assert not fast_path.fast_path(ON_CUDA)  # nested: restored to the outer one's
        assert fast_path.fast_path(ON_CUDA)
    assert not fast_path.fast_path(ON_CUDA)  # grad mode: the reference


def test_an_llm_puts_its_engine_configs_switches_in_force(tmp_path, monkeypatch):
    """LLM(kernels=...) reaches the process's switches (and its environment overrides with it)."""
    target = make_target(tmp_path / "t", "llama", vocab=64)
    LLM(str(target), None, device="cpu", kernels=KernelConfig(pdl=False))
    assert active_kernels() == KernelConfig(pdl=False)
    monkeypatch.setenv("BLOCKSPEC_FP8_KERNEL", "0")
    LLM(str(target), None, device="cpu")
    assert active_kernels() == KernelConfig(fp8_kernel=False)
