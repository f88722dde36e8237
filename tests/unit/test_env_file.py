"""shared/env_file.py: KEY=VALUE lines, comments, quotes, paths relative to the file, and the
process environment winning over every file."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.env_file import EnvFileError, apply_env_files, env_from_files, parse_env_file


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_comments_blank_lines_quotes_and_export(tmp_path: Path) -> None:
    f = write(
        tmp_path / "md.env",
        "# a bundle's env file\n"
        "\n"
        "PDD_MD_INSTANCE=md-0   # trailing comment\n"
        "export PDD_MD_DATACENTER=dc-b\n"
        "PDD_MD_NATS_URL='tls://10.0.0.2:4222,tls://10.0.0.3:4222'\n"
        'PDD_MD_MODEL__PATH="/models/with space # not a comment"\n'
        'PDD_X="a\\"b\\\\c\\nd"\n'
        "PDD_HASH=abc#def\n"
        "PDD_Q='quoted' # a note\n"
        "PDD_EMPTY=\n",
    )
    assert parse_env_file(f) == {
        "PDD_MD_INSTANCE": "md-0",
        "PDD_MD_DATACENTER": "dc-b",
        "PDD_MD_NATS_URL": "tls://10.0.0.2:4222,tls://10.0.0.3:4222",
        "PDD_MD_MODEL__PATH": "/models/with space # not a comment",
        "PDD_X": 'a"b\\c\nd',
        "PDD_HASH": "abc#def",
        "PDD_Q": "quoted",
        "PDD_EMPTY": "",
    }


def test_relative_paths_of_file_keys_are_taken_from_the_files_directory(tmp_path: Path) -> None:
    f = write(
        tmp_path / "bundle" / "main_decode.env",
        "PDD_MD_TLS_CA=ca.pem\n"
        "PDD_MD_TLS_CERT=./main_decode.pem\n"
        "PDD_MD_TLS_KEY=/abs/main_decode.key\n"
        "PDD_MD_SECRET_FILE=kv-local-secret\n"
        "PDD_MD_BULK_ADDRESS=tcp://0.0.0.0:7400\n"  # not a path key: as is
        "PDD_ROUTER_API_KEYS=k1\n",  # _KEYS is not _KEY
    )
    got = parse_env_file(f)
    bundle = (tmp_path / "bundle").resolve()
    assert got["PDD_MD_TLS_CA"] == str(bundle / "ca.pem")
    assert Path(got["PDD_MD_TLS_CERT"]) == bundle / "main_decode.pem"
    assert got["PDD_MD_TLS_KEY"] == "/abs/main_decode.key"
    assert got["PDD_MD_SECRET_FILE"] == str(bundle / "kv-local-secret")
    assert got["PDD_MD_BULK_ADDRESS"] == "tcp://0.0.0.0:7400"
    assert got["PDD_ROUTER_API_KEYS"] == "k1"


@pytest.mark.parametrize("line", ["NOEQUALS", "1BAD=x", "PDD_A='open", 'PDD_A="x" y'])
def test_malformed_lines_name_file_and_line(tmp_path: Path, line: str) -> None:
    f = write(tmp_path / "bad.env", f"# ok\n{line}\n")
    with pytest.raises(EnvFileError, match=r"bad\.env:2"):
        parse_env_file(f)


def test_the_environment_wins_and_a_later_file_over_an_earlier(tmp_path: Path) -> None:
    a = write(tmp_path / "a.env", "PDD_A=from-a\nPDD_B=from-a\nPDD_C=from-a\n")
    b = write(tmp_path / "b.env", "PDD_B=from-b\nPDD_C=from-b\n")
    environ = {"PDD_C": "operator"}
    assert env_from_files([a, b], environ) == {"PDD_A": ("from-a", a), "PDD_B": ("from-b", b)}
    assert apply_env_files([a, b], environ) == {"PDD_A": a, "PDD_B": b}
    assert environ == {"PDD_A": "from-a", "PDD_B": "from-b", "PDD_C": "operator"}
