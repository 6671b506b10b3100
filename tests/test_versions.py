"""Version floors: setup.cfg and the import-time check agree, and a too-old dependency fails on import with
the installed and the needed versions named."""

import configparser
import importlib.metadata

import pytest

from k2jax import _versions
from tests.conftest import REPO


def test_setup_cfg_declares_the_floors_the_import_check_holds():
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    floors = dict(line.split(">=") for line in cfg["options"]["install_requires"].split() if ">=" in line)
    assert floors == _versions.FLOORS


def test_installed_versions_pass():
    _versions.check()


def test_too_old_jax_is_an_import_error_naming_both_versions():
    def installed(name):
        return {"jax": "0.6.2", "jaxlib": "0.6.2"}.get(name) or importlib.metadata.version(name)

    with pytest.raises(ImportError, match=r"jax 0\.6\.2 is installed, k2jax needs jax>=0\.7\.1; "
                                          r"jaxlib 0\.6\.2 is installed, k2jax needs jaxlib>=0\.7\.1"):
        _versions.check(installed)


@pytest.mark.parametrize("version, parsed", [("0.12.0.1", (0, 12, 0, 1)), ("0.8.0rc1", (0, 8, 0)),
                                             ("0.7.1+cuda12", (0, 7, 1))])
def test_parse(version, parsed):
    assert _versions.parse(version) == parsed
