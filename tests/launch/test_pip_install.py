"""launch/pip_install.py: uv is given the settings pip would have used."""
from __future__ import annotations

from launch.pip_install import pip_settings, uv_options

# `pip config list` on the CI image (/etc/pip.conf, /etc/xdg/pip/pip.conf, PIP_* variables)
CI_IMAGE = """\
:env:.cert='/etc/ssl/certs/ca-certificates.crt'
:env:.find-links='/opt/wheels'
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/opt/wheels'
"""


def test_the_ci_images_settings_become_uvs_options() -> None:
    settings = pip_settings(CI_IMAGE, {"PIP_FIND_LINKS": "/opt/wheels"})
    assert uv_options(settings) == [
        "--extra-index-url", "file:///opt/pypi/simple",
        "--extra-index-url", "file:///opt/pypi-more/simple",
        "--find-links", "/opt/wheels", "--constraint", "/etc/xdg/pip/constraints.txt"]
    assert settings["cert"] == "/etc/ssl/certs/ca-certificates.crt"


def test_the_environment_wins_then_install_then_global() -> None:
    config = ("install.index-url='https://mirror.example/simple'\n"
              "global.index-url='https://other.example/simple'\n"
              "global.find-links='a\\nb'\n"  # a multi-line value, as pip prints it
              "download.find-links='ignored'\n")
    assert uv_options(pip_settings(config, {})) == [
        "--index-url", "https://mirror.example/simple", "--find-links", "a",
        "--find-links", "b"]
    assert uv_options(pip_settings(config, {"PIP_INDEX_URL": "https://env.example/simple",
                                            "PIP_FIND_LINKS": ""})) == [
        "--index-url", "https://env.example/simple",
        "--find-links", "a", "--find-links", "b"]


def test_no_configuration_means_no_options() -> None:
    assert uv_options(pip_settings("", {})) == []
