"""Shared argument checks: positive ints, query text, what ``retrieve`` accepts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from llama_index.core.schema import QueryBundle

from llama_index_retrieval_kit.retrievers.checks import check_positive_int, check_query_text, checked_query


@given(st.integers(1, 10**12))
def test_positive_ints_pass_unchanged(value: int) -> None:
    assert check_positive_int("similarity_top_k", value) == value


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("5", "'5' (str)"),
        (None, "None (NoneType)"),
        (True, "True (bool)"),
        (False, "False (bool)"),
        (5.0, "5.0 (float)"),
        (0, "0 (int)"),
        (-3, "-3 (int)"),
    ],
)
def test_non_positive_ints_are_refused_naming_value_and_type(value: object, shown: str) -> None:
    with pytest.raises(ValueError) as caught:
        check_positive_int("similarity_top_k", value)
    assert str(caught.value) == f"similarity_top_k must be an int >= 1, got {shown}"


@given(st.text())
def test_valid_unicode_text_passes(text: str) -> None:
    # Hypothesis' text() never holds surrogates (they are not Unicode scalar values).
    assert check_query_text(text) is text


@given(st.text(max_size=20), st.integers(0xD800, 0xDFFF), st.text(max_size=20))
def test_a_lone_surrogate_is_refused_with_its_position(before: str, code: int, after: str) -> None:
    with pytest.raises(ValueError) as caught:
        check_query_text(before + chr(code) + after)
    message = str(caught.value)
    assert f"lone surrogate ({chr(code)!r}) at position {len(before)}" in message
    assert "text.encode('utf-8', 'replace').decode()" in message
    message.encode("utf-8")  # the message itself is printable text


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (b"fees", r"must be a str, got bytes b'fees': decode it first"),
        (bytearray(b"fees"), r"must be a str, got bytearray b'fees': decode it first"),
        (None, r"must be a str, got NoneType None"),
        (42, r"must be a str, got int 42"),
    ],
)
def test_query_text_of_another_type_is_refused(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_query_text(value)


def test_checked_query_accepts_strings_and_bundles_and_refuses_the_rest() -> None:
    bundle = QueryBundle(query_str="annual fee")
    assert checked_query("annual fee") == "annual fee"
    assert checked_query(bundle) is bundle
    with pytest.raises(ValueError, match=r"the query must be a str, got bytes b'fees': decode it first"):
        checked_query(b"fees")
    with pytest.raises(ValueError, match=r"QueryBundle.query_str must be a str, got bytes"):
        checked_query(QueryBundle(query_str=b"fees"))  # type: ignore[arg-type]
    for value in (None, 3, ["fees"]):
        with pytest.raises(ValueError, match=rf"the query must be a str or a QueryBundle, got {type(value).__name__}"):
            checked_query(value)
