"""Hardware presets, overrides and their errors."""
import pytest

from partir_torch.errors import PartitionError
from partir_torch.mesh import Mesh
from partir_torch.sim import Hardware, collective_time, hardware
from partir_torch.sim.hardware import PRESETS


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_complete(name):
    hw = hardware(name)
    assert isinstance(hw, Hardware)
    assert hw.peak_bf16 > hw.peak_fp32 > 0 and hw.hbm_bw > 0 and hw.hbm_bytes > 0
    assert hw.num_devices >= 1
    if hw.kind == "gpu":
        assert hw.nvlink_bw > hw.nic_bw > 0 and hw.num_devices == 8
    else:
        assert hw.ici_link_bw > 0 and hw.dcn_bw > 0


def test_spec_numbers():
    assert hardware("a100-80g").peak_bf16 == 312e12 and hardware("a100-80g").hbm_bw == 2039e9
    assert hardware("h100").nvlink_bw == 450e9 and hardware("h100").nvls
    assert not hardware("a100-40g").nvls
    assert hardware("tpu-v5p").ici_link_bw == 90e9


def test_every_chip_figure_is_in_the_hardware_reference():
    """docs/hardware.md holds the chips' datasheet figures: the row of each preset names its bf16 rate, HBM
    bandwidth and HBM size as the datasheet writes them (1,979; 80 GB; 32 GiB)."""
    from pathlib import Path

    from partir_torch.sim.hardware import CHIPS, GB, NETWORKS, GiB

    doc = Path(__file__).resolve().parents[1] / "docs" / "hardware.md"
    rows = {line.split("|")[1].strip(" `"): line for line in doc.read_text().splitlines()
            if line.startswith("| `")}
    for name, chip in CHIPS.items():
        row = rows[name]
        hbm = f"{chip.hbm_bytes / GiB:g} GiB" if chip.hbm_bytes % GiB == 0 else f"{chip.hbm_bytes / GB:g} GB"
        for figure in (f"{chip.peak_bf16 / 1e12:,g}", f"{chip.hbm_bw / GB:,g}", hbm):
            assert f"| {figure} |" in row or f"| {figure} " in row, (name, figure, row)
    assert {c.confidence for c in CHIPS.values()} >= {n for c in CHIPS.values() for n in c.nearest}
    assert all(x.source.startswith("spec: ") for x in [*CHIPS.values(), *NETWORKS.values()])


def test_overrides_and_device_counts():
    hw = hardware("h100", nodes=4, nic_bw=25e9)
    assert hw.num_devices == 32 and hw.nic_bw == 25e9 and hw.name == "h100"
    assert hardware("tpu-v4", topology=(4, 4, 8), slices=2).num_devices == 256
    assert hardware("tpu-v5e", topology=(16, 16)).num_devices == 256
    with pytest.raises(Exception):
        hw.nodes = 2                                             # frozen


def test_dtype_peaks_and_tf32():
    hw = hardware("a100-80g")
    assert hw.peak_flops("bfloat16") == hw.peak_flops("float16") == 312e12
    assert hw.peak_flops("float32") == 19.5e12
    assert hardware("a100-80g", tf32=True).peak_flops("float32") == 156e12


def test_unknown_field_lists_valid_fields():
    with pytest.raises(PartitionError) as e:
        hardware("h100", node=2)
    msg = str(e.value)
    assert "'node'" in msg and "nodes" in msg and "gpus_per_node" in msg and "nic_bw" in msg


def test_unknown_preset_suggests():
    with pytest.raises(PartitionError, match="h100"):
        hardware("h10")


def test_gpu_tpu_fields_do_not_mix():
    with pytest.raises(PartitionError, match="nodes"):
        hardware("h100", topology=(2, 2))
    with pytest.raises(PartitionError, match="topology"):
        hardware("tpu-v4", nodes=2)
    with pytest.raises(PartitionError, match="16x16"):
        hardware("tpu-v5e", topology=(32, 8))
    with pytest.raises(PartitionError, match="positive int"):
        hardware("h100", nodes=0)


def test_wraparound_rules():
    assert hardware("tpu-v4", topology=(4, 4, 4)).torus_wraparound == (True, True, True)
    assert hardware("tpu-v4", topology=(2, 2, 1)).torus_wraparound == (False, False, False)
    assert hardware("tpu-v5p", topology=(4, 4, 8)).torus_wraparound == (True, True, True)
    assert hardware("tpu-v5e", topology=(16, 16)).torus_wraparound == (True, True)
    assert hardware("tpu-v5e", topology=(4, 16)).torus_wraparound == (False, True)
    assert hardware("tpu-v6e", topology=(8, 8)).torus_wraparound == (False, False)
    assert hardware("tpu-v5e", topology=(16, 16), wraparound=(False, True)).torus_wraparound == (False, True)


def test_mesh_size_mismatch_names_both_numbers_and_the_fix():
    with pytest.raises(PartitionError) as e:
        collective_time(hardware("h100", nodes=2), "all_reduce", 1 << 20, Mesh({"dp": 24}), "dp")
    assert "24 devices" in str(e.value) and "has 16" in str(e.value) and "nodes=3" in str(e.value)
    with pytest.raises(PartitionError, match=r"topology=\(16, 16\), slices=2"):
        collective_time(hardware("tpu-v5e", topology=(16, 16)), "all_reduce", 1 << 20, Mesh({"dp": 512}), "dp")
    # a smaller mesh: its groups lie on the first GPUs, as on a machine of exactly that size
    small = collective_time(hardware("h100", nodes=2), "all_reduce", 1 << 20, Mesh({"dp": 8}), "dp")
    assert small == collective_time(hardware("h100"), "all_reduce", 1 << 20, Mesh({"dp": 8}), "dp")


def test_presets_carry_the_fit_whose_held_out_error_the_confidence_column_reports():
    from partir_torch.sim.fitted import FITTED
    from partir_torch.sim.hardware import with_knobs

    raw, fit = hardware("h100", calibrated=False), hardware("h100")
    assert fit == with_knobs(raw, FITTED)
    assert fit.sustained_clock == FITTED["sustained_clock"] and raw.sustained_clock == 1.0
    assert fit.attn_efficiency == pytest.approx(min(raw.attn_efficiency * FITTED["attn_efficiency"], raw.mm_efficiency))
    tpu, tpu_raw = hardware("tpu-v5e"), hardware("tpu-v5e", calibrated=False)
    assert tpu.mm_efficiency == FITTED["tpu_mm_efficiency"] and tpu.sustained_clock == tpu_raw.sustained_clock
    assert fit.mm_efficiency == raw.mm_efficiency                  # the TPU knob leaves GPUs alone
    assert hardware("h100", sustained_clock=0.5).sustained_clock == 0.5   # a user's override wins over the fit
