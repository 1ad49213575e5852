"""Dataset loaders: shapes, label ranges, determinism, and the quadratics' math."""

from __future__ import annotations

import gzip
import hashlib
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from backpack import backpack, extend
from backpack.extensions import SqrtGGNExact

from benchmarks.problems import data, quadratics
from benchmarks.problems.models import quadratic_model

# sha256 of float64 bytes drawn by numpy.random.default_rng (PCG64; platform
# independent). Recorded from benchmarks.problems.quadratics at the time of writing.
DEEPOBS_TRAIN_SAMPLES_SHA256 = (
    "493da7b6526a0f091093e6be25aeb9057d7b44145459e2f50a98ef25df903167"
)
DEEPOBS_EIGENVALUES_SHA256 = (
    "d332ff38f0a59275c79cbf91ed90c763ea8b30bb2fd764eeca7fd7542e4eda8c"
)


def sha256(*arrays: np.ndarray | torch.Tensor) -> str:
    """Hash of the arrays' bytes (C order)."""
    digest = hashlib.sha256()
    for a in arrays:
        a = a.numpy() if isinstance(a, torch.Tensor) else a
        digest.update(np.ascontiguousarray(a).tobytes())
    return digest.hexdigest()


def assert_standardized(x: torch.Tensor) -> None:
    """Every non-constant feature has mean 0 and std 1 (float64)."""
    mean, std = x.mean(0), x.std(0, unbiased=False)
    varying = std > 0
    assert torch.allclose(mean, torch.zeros_like(mean), atol=1e-12), mean.abs().max()
    assert torch.allclose(std[varying], torch.ones_like(std[varying]), atol=1e-12)


def test_digits_split_shapes_labels_standardization():
    ds = data.load_digits()
    assert ds.x_train.shape == (1347, 64) and ds.x_test.shape == (450, 64)
    assert ds.x_train.dtype == torch.float64 and ds.y_train.dtype == torch.int64
    for y in (ds.y_train, ds.y_test):
        assert set(y.unique().tolist()) == set(range(10))
    assert_standardized(ds.x_train)
    assert sha256(*ds.tensors()) == sha256(*data.load_digits().tensors())


@pytest.mark.slow
def test_mnist1d_is_offline_deterministic_and_leaves_global_rngs_alone():
    python_state, numpy_state = random.getstate(), np.random.get_state()  # noqa: NPY002
    first = sha256(*data.load_mnist1d().tensors())  # generated now or earlier
    data._mnist1d_arrays.cache_clear()
    ds = data.load_mnist1d()  # generated again
    assert sha256(*ds.tensors()) == first, "make_dataset with a fixed seed changed"
    assert random.getstate() == python_state
    assert np.array_equal(np.random.get_state()[1], numpy_state[1])  # noqa: NPY002
    assert ds.x_train.shape == (4000, 40) and ds.x_test.shape == (1000, 40)
    assert set(ds.y_train.unique().tolist()) == set(range(10))
    assert data.load_mnist1d(channels=True).x_train.shape == (4000, 1, 40)


def test_haar_rotation_is_a_rotation():
    r = quadratics.haar_rotation(7, np.random.default_rng(3))
    np.testing.assert_allclose(r @ r.T, np.eye(7), atol=1e-12)
    assert np.linalg.det(r) == pytest.approx(1.0, abs=1e-12)


def test_deepobs_spectrum_and_samples_are_recorded_values():
    rng = np.random.default_rng(42)
    eigenvalues = quadratics.deepobs_eigenvalues(rng)
    assert ((eigenvalues[:90] >= 0) & (eigenvalues[:90] <= 1)).all()
    assert ((eigenvalues[90:] >= 30) & (eigenvalues[90:] <= 60)).all()
    train = quadratics.gaussian_samples(1000, 100, 0.6, 42)
    assert sha256(train) == sha256(quadratics.gaussian_samples(1000, 100, 0.6, 42))
    assert sha256(eigenvalues) == DEEPOBS_EIGENVALUES_SHA256
    assert sha256(train) == DEEPOBS_TRAIN_SAMPLES_SHA256


def test_deepobs_readout_has_the_deepobs_spectrum():
    readout = quadratics.deepobs_readout(seed=42)
    hessian = quadratics.hessian_from_readout(readout)
    expected = np.sort(quadratics.deepobs_eigenvalues(np.random.default_rng(42)))
    np.testing.assert_allclose(np.linalg.eigvalsh(hessian), expected, atol=1e-10)


@pytest.fixture(
    params=[
        ("quadratic_deep", lambda: quadratics.deepobs_readout(seed=42)),
        ("noisy_quadratic", lambda: quadratics.squares_readout(dim=20, seed=0)),
    ],
    ids=lambda p: p[0],
)
def readout(request) -> np.ndarray:
    """Read-out matrices of the two quadratic problems."""
    return request.param[1]()


def test_quadratic_model_loss_is_the_quadratic(readout):
    """MSELoss of the read-out model equals mean ½(θ − x)ᵀH(θ − x), in float64."""
    dim = readout.shape[0]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, dim))
    theta = rng.normal(size=dim)
    model = quadratic_model(readout, generator=torch.Generator())
    with torch.no_grad():
        model[0].weight.copy_(torch.from_numpy(theta)[:, None])
    targets = torch.from_numpy(x @ readout.T)
    loss = torch.nn.MSELoss()(model(torch.ones(5, 1, dtype=torch.float64)), targets)
    hessian = quadratics.hessian_from_readout(readout)
    diff = theta - x
    expected = 0.5 * np.einsum("ni,ij,nj->n", diff, hessian, diff).mean()
    assert loss.item() == pytest.approx(expected, rel=1e-12)


def test_quadratic_model_ggn_is_the_hessian(readout):
    """BackPACK's exact GGN of one sample is H (so subsampling_ggn=[0] is exact)."""
    model = extend(quadratic_model(readout, generator=torch.Generator()))
    loss_fn = extend(torch.nn.MSELoss())
    dim = readout.shape[0]
    loss = loss_fn(
        model(torch.ones(1, 1, dtype=torch.float64)),
        torch.zeros(1, dim, dtype=torch.float64),
    )
    with backpack(SqrtGGNExact()):
        loss.backward()
    (theta,) = [p for p in model.parameters() if p.requires_grad]
    v = theta.sqrt_ggn_exact.reshape(-1, dim)
    ggn = (v.T @ v).numpy()
    hessian = quadratics.hessian_from_readout(readout)
    np.testing.assert_allclose(
        ggn, hessian, rtol=1e-10, atol=1e-10 * np.abs(hessian).max()
    )


def test_noisy_quadratic_gradient_noise_and_excess_loss():
    readout = quadratics.squares_readout(dim=20, seed=0)
    hessian = quadratics.hessian_from_readout(readout)
    np.testing.assert_allclose(
        np.linalg.eigvalsh(hessian), np.arange(1, 21) ** 2, rtol=1e-10
    )
    x = quadratics.gradient_noise_samples(readout, 4, 70.7, seed=5)
    xi = np.random.default_rng(5).normal(0.0, 70.7, size=(4, 20))
    np.testing.assert_allclose(-hessian @ x.T, -xi.T, rtol=1e-9, atol=1e-9)
    ds = data.load_noisy_quadratic(readout, num_train=8)
    assert ds.x_test.shape == (1, 1) and torch.equal(ds.y_test, torch.zeros(1, 20))
    model = quadratic_model(readout, init_value=100.0, generator=torch.Generator())
    with torch.no_grad():
        test_loss = torch.nn.MSELoss()(model(ds.x_test), ds.y_test).item()
    theta = np.full(20, 100.0)
    assert test_loss == pytest.approx(0.5 * theta @ hessian @ theta, rel=1e-12)


def test_quadratic_deep_dataset_is_deterministic():
    readout = quadratics.deepobs_readout(seed=42)
    first = data.load_quadratic_deep(readout)
    assert first.x_train.shape == (1000, 1) and first.y_train.shape == (1000, 100)
    assert sha256(*first.tensors()) == sha256(
        *data.load_quadratic_deep(quadratics.deepobs_readout(seed=42)).tensors()
    )


def write_idx(path: Path, array: np.ndarray, code: int) -> None:
    """Write an IDX file (gzip-compressed for a .gz suffix)."""
    header = bytes([0, 0, code, array.ndim]) + np.array(array.shape, ">u4").tobytes()
    payload = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wb") as f:
        f.write(payload)


@pytest.mark.parametrize(
    ("dtype", "code"),
    [(np.uint8, 0x08), (np.int32, 0x0C), (np.float64, 0x0E)],
    ids=["uint8", "int32", "float64"],
)
@pytest.mark.parametrize("suffix", ["", ".gz"], ids=["plain", "gzip"])
def test_read_idx_roundtrip(tmp_path, dtype, code, suffix):
    array = (np.arange(2 * 3 * 4) * 7 % 251).astype(dtype).reshape(2, 3, 4)
    path = tmp_path / f"a-idx3-ubyte{suffix}"
    write_idx(path, array, code)
    out = data.read_idx(path)
    assert out.dtype == np.dtype(dtype) and out.shape == (2, 3, 4)
    np.testing.assert_array_equal(out, array)


def test_read_idx_rejects_bad_files(tmp_path):
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x12\x34\x08\x01\x00\x00\x00\x01\x00")
    with pytest.raises(ValueError, match="not an IDX file"):
        data.read_idx(bad)
    short = tmp_path / "short"
    write_idx(short, np.zeros(5, np.uint8), 0x08)
    short.write_bytes(short.read_bytes()[:-1])
    with pytest.raises(ValueError, match="announces shape"):
        data.read_idx(short)


def test_fashion_mnist_reader_on_small_files(tmp_path):
    gen = np.random.default_rng(0)
    for split, num in (("train", 6), ("t10k", 4)):
        images = gen.integers(0, 256, size=(num, 28, 28)).astype(np.uint8)
        write_idx(tmp_path / f"{split}-images-idx3-ubyte.gz", images, 0x08)
        labels = np.arange(num, dtype=np.uint8) % 10
        write_idx(tmp_path / f"{split}-labels-idx1-ubyte", labels, 0x08)
    ds = data.load_fashion_mnist(root=str(tmp_path))
    assert ds.x_train.shape == (6, 784) and ds.x_test.shape == (4, 784)
    assert 0 <= ds.x_train.min() and ds.x_train.max() <= 1
    assert ds.y_train.tolist() == list(range(6)) and ds.y_train.dtype == torch.int64
    images = data.load_fashion_mnist(root=str(tmp_path), flatten=False)
    assert images.x_test.shape == (4, 1, 28, 28)


def test_fashion_mnist_missing_files_say_how_to_install(tmp_path):
    with pytest.raises(
        FileNotFoundError, match="apt-get install dataset-fashion-mnist"
    ):
        data.load_fashion_mnist(root=str(tmp_path))


@pytest.mark.skipif(
    not Path(data.FASHION_MNIST_DIR).is_dir(),
    reason="Debian's dataset-fashion-mnist is not installed",
)
def test_fashion_mnist_from_the_debian_package():
    ds = data.load_fashion_mnist()
    assert ds.x_train.shape == (60000, 784) and ds.x_test.shape == (10000, 784)
    assert set(ds.y_test.unique().tolist()) == set(range(10))
    assert torch.bincount(ds.y_train).tolist() == [6000] * 10
