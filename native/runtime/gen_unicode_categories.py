"""Writes unicode_categories.h, the Unicode tables of the native BPE tokenizer (bpe_tokenizer.cc): the code point
ranges of \\p{L} and \\p{N}, the White_Space property (what `\\s` matches in the pre-tokenizer regexes), and the
canonical combining classes, decompositions and compositions that NFC needs.

    python native/runtime/gen_unicode_categories.py [--output PATH]

Each table follows the Unicode version that the `tokenizers` library (0.23) uses for it, so that the native
tokenizer splits and normalizes as it does:
  - \\p{L} and \\p{N}: its regex engine has Unicode 16.0, which the unicodedata2 package pins here (16.0.0, in
    pyproject.toml's test extra; Python 3.11's unicodedata has 14.0, ~9,400 fewer letters and numbers: CJK
    extensions H and I, Kawi, Garay...). Both newer unicodedata2 releases and older data split differently;
  - NFC: its normalizer has Unicode 14.0, as Python 3.11's unicodedata (unicodedata2 16.0.0 would compose and
    order about 80 sequences with the newer marks differently from it).
The output depends only on those two versions, written into the header.
"""

from __future__ import annotations

import argparse
import sys
import unicodedata
from pathlib import Path

try:
    import unicodedata2
except ImportError:  # pragma: no cover - the message is the point
    sys.exit("gen_unicode_categories.py needs unicodedata2==16.0.0 (pip install -e '.[test]')")

CATEGORY_UNICODE_VERSION = "16.0.0"
if unicodedata2.unidata_version != CATEGORY_UNICODE_VERSION:
    sys.exit(f"gen_unicode_categories.py needs unicodedata2 with Unicode {CATEGORY_UNICODE_VERSION} (the version of "
             f"the tokenizers library's regex engine), not {unicodedata2.unidata_version}: "
             f"pip install unicodedata2=={CATEGORY_UNICODE_VERSION}")

LETTER_CATEGORIES = {"Lu", "Ll", "Lt", "Lm", "Lo"}
NUMBER_CATEGORIES = {"Nd", "Nl", "No"}
# The White_Space property (PropList.txt). unicodedata does not expose it, and str.isspace() is not it: that also
# counts U+001C..U+001F.
WHITE_SPACE = [(0x0009, 0x000D), (0x0020, 0x0020), (0x0085, 0x0085), (0x00A0, 0x00A0), (0x1680, 0x1680),
               (0x2000, 0x200A), (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000)]
# Precomposed Hangul syllables decompose and compose by arithmetic (bpe_tokenizer.cc), not through the tables.
HANGUL_SYLLABLES = range(0xAC00, 0xAC00 + 11172)
CODE_POINTS = range(0x110000)
LINE_WIDTH = 118


def ranges_where(predicate) -> list[tuple[int, int]]:
    """The maximal runs [first, last] of code points for which predicate holds."""
    runs: list[tuple[int, int]] = []
    for cp in CODE_POINTS:
        if predicate(cp):
            if runs and runs[-1][1] == cp - 1:
                runs[-1] = (runs[-1][0], cp)
            else:
                runs.append((cp, cp))
    return runs


def combining_class_ranges() -> list[tuple[int, int, int]]:
    """Runs [first, last, class] of consecutive code points sharing a non-zero canonical combining class."""
    runs: list[tuple[int, int, int]] = []
    for cp in CODE_POINTS:
        ccc = unicodedata.combining(chr(cp))
        if ccc == 0:
            continue
        if runs and runs[-1][1] == cp - 1 and runs[-1][2] == ccc:
            runs[-1] = (runs[-1][0], cp, ccc)
        else:
            runs.append((cp, cp, ccc))
    return runs


def canonical_decompositions() -> list[tuple[int, int, int]]:
    """(code point, first, second) for each one-level canonical decomposition; second is 0 for a singleton."""
    entries = []
    for cp in CODE_POINTS:
        if cp in HANGUL_SYLLABLES:
            continue
        fields = unicodedata.decomposition(chr(cp)).split()
        if not fields or fields[0].startswith("<"):  # none, or a compatibility decomposition (NFKC only)
            continue
        parts = [int(f, 16) for f in fields]
        entries.append((cp, parts[0], parts[1] if len(parts) == 2 else 0))
    return entries


def canonical_compositions(decompositions) -> list[tuple[int, int, int]]:
    """(first, second, composite), sorted, for the primary composites: the pairs NFC recombines. A two-part
    decomposition whose code point NFC does not give back is a composition exclusion."""
    pairs = [(first, second, cp) for cp, first, second in decompositions
             if second and unicodedata.normalize("NFC", chr(cp)) == chr(cp)]
    return sorted(pairs)


def c_table(declaration: str, rows: list[tuple[int, ...]], last_is_class: bool = False) -> str:
    """The rows as a C array, code points in hex, a trailing combining class in decimal."""
    def cell(row):
        values = [f"0x{v:04X}" for v in row]
        if last_is_class:
            values[-1] = str(row[-1])
        return "{" + ", ".join(values) + "},"

    cells = [cell(row) for row in rows]
    lines = ["   "]
    for cell in cells:
        if len(lines[-1]) + 1 + len(cell) > LINE_WIDTH:
            lines.append("   ")
        lines[-1] += " " + cell
    return f"{declaration} = {{\n" + "\n".join(lines) + "\n};\n"


def header_text() -> str:
    letters = ranges_where(lambda cp: unicodedata2.category(chr(cp)) in LETTER_CATEGORIES)
    numbers = ranges_where(lambda cp: unicodedata2.category(chr(cp)) in NUMBER_CATEGORIES)
    decompositions = canonical_decompositions()
    compositions = canonical_compositions(decompositions)
    parts = [
        "// unicode_categories.h: Unicode tables for bpe_tokenizer.cc, generated by gen_unicode_categories.py:\n"
        f"// letters and numbers from unicodedata2 (Unicode {unicodedata2.unidata_version}), NFC data from Python's "
        f"unicodedata (Unicode {unicodedata.unidata_version}),\n"
        "// the versions the tokenizers library has for them. Do not edit; regenerate with\n"
        "//     python native/runtime/gen_unicode_categories.py\n"
        "// Ranges are inclusive [first, last] and sorted, for binary search.\n"
        "#ifndef MOBILEC_NATIVE_RUNTIME_UNICODE_CATEGORIES_H_\n"
        "#define MOBILEC_NATIVE_RUNTIME_UNICODE_CATEGORIES_H_\n\n"
        "#include <cstdint>\n\n"
        "namespace mobilec {\n"
        "namespace unicode {\n\n"
        f'constexpr const char kCategoryUnicodeVersion[] = "{unicodedata2.unidata_version}";  // kLetters, kNumbers\n'
        f'constexpr const char kNormalizationUnicodeVersion[] = "{unicodedata.unidata_version}";  // the NFC tables\n\n'
        "struct Range {\n  uint32_t first, last;\n};\n"
        "struct CombiningClassRange {\n  uint32_t first, last, combining_class;\n};\n"
        "// `second` is 0 when the code point decomposes to one code point.\n"
        "struct Decomposition {\n  uint32_t code_point, first, second;\n};\n"
        "struct Composition {\n  uint32_t first, second, composite;\n};\n\n",
        "// \\p{L}: general categories Lu, Ll, Lt, Lm, Lo.\n",
        c_table("constexpr Range kLetters[]", letters),
        "\n// \\p{N}: general categories Nd, Nl, No.\n",
        c_table("constexpr Range kNumbers[]", numbers),
        "\n// \\s: the White_Space property.\n",
        c_table("constexpr Range kWhiteSpace[]", WHITE_SPACE),
        "\n// Non-zero canonical combining classes.\n",
        c_table("constexpr CombiningClassRange kCombiningClasses[]", combining_class_ranges(), last_is_class=True),
        "\n// One-level canonical decompositions (apply recursively), sorted by code point; no Hangul syllables.\n",
        c_table("constexpr Decomposition kDecompositions[]", decompositions),
        "\n// Primary composites, sorted by (first, second); Hangul syllables excluded.\n",
        c_table("constexpr Composition kCompositions[]", compositions),
        "\n}  // namespace unicode\n}  // namespace mobilec\n\n",
        "#endif  // MOBILEC_NATIVE_RUNTIME_UNICODE_CATEGORIES_H_\n",
    ]
    return "".join(parts)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path(__file__).with_name("unicode_categories.h"))
    args = parser.parse_args(argv)
    args.output.write_text(header_text(), encoding="ascii")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
