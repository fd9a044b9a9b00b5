"""Argument checks, one message form for all of fitdp.

Every message reads ``<argument>: got <what was received>; expected <what was expected>.
Fix: <how>.``, and is raised before anything changes (a TypeError for the wrong kind of
value, a ValueError for the right kind with a wrong value).
"""

from __future__ import annotations

import difflib
import inspect
import math
import numbers
import os
import stat
import weakref
from collections.abc import Collection, Iterable
from typing import Any, NoReturn


class FitdpWarning(UserWarning):
    """The class of every warning fitdp gives (a UserWarning: users' filters catch it)."""


def describe(value: Any) -> str:
    """A short description of a received value for messages: its repr and, for non-numbers,
    its type (``'5' (str)``). Long reprs are cut to 60 characters, never a string or path:
    a cut path loses its file name, what matters most."""
    text = repr(value)
    if len(text) > 60 and not isinstance(value, (str, os.PathLike)):
        text = text[:57] + "..."
    if isinstance(value, (bool, int, float)) and not isinstance(value, bool):
        return text
    return f"{text} ({type(value).__name__})"


def fail(name: str, got: Any, expected: str, fix: str = "", *,
         error: type[Exception] = ValueError, described: bool = False) -> NoReturn:
    """Raise ``error`` with the one message form.

    Args:
        name: the argument, as the user wrote it (``"lr"``, ``"fit(validation_data=...)"``).
        got: the value received (described with ``describe``), or a description of it when
            ``described``.
        expected: what would have been accepted.
        fix: how to fix it (omitted when empty).
        error: the exception class.
        described: ``got`` is already a description.

    Example:
        >>> fail("lr", -1.0, "a number >= 0", "pass lr=1e-3")
        Traceback (most recent call last):
        ...
        ValueError: lr: got -1.0; expected a number >= 0. Fix: pass lr=1e-3.
    """
    received = got if described else describe(got)
    tail = f" Fix: {fix.rstrip('.')}." if fix else ""
    raise error(f"{name}: got {received}; expected {expected}.{tail}")


def reworded(err: Exception, message: str, fallback: type[Exception] = RuntimeError
             ) -> Exception:
    """``err``'s own class with ``message`` (raise it ``from err``), or ``fallback`` for an
    exception class that takes other arguments. ``first_line(err)`` is what to quote."""
    try:
        return type(err)(message)
    except Exception:  # noqa: BLE001 - its constructor wants something else
        return fallback(message)


def first_line(err: BaseException) -> str:
    """The first line of ``err``'s message without its final period, or its class name."""
    text = str(err).strip()
    return text.splitlines()[0].rstrip(".") if text else type(err).__name__


def check_int(name: str, value: Any, minimum: int | None = None, *, maximum: int | None = None,
              fix: str = "") -> int:
    """``value`` as an int (numpy ints too; bools refused), from ``minimum`` to ``maximum``.

    Args:
        name: the argument's name.
        value: what was received.
        minimum, maximum: bounds, both included (None: unbounded). A count that reaches
            torch or ``itertools`` is bounded by what a C integer holds (``sys.maxsize``),
            so ``10**30`` is refused here instead of overflowing there.
        fix: how to fix a bad value.

    Raises:
        TypeError: not an int. ValueError: out of bounds.

    Example:
        >>> check_int("epochs", 3, 0)
        3
    """
    if maximum is None:
        expected = "an int" if minimum is None else f"an int >= {minimum}"
    else:
        expected = f"an int <= {maximum}" if minimum is None else (
            f"an int from {minimum} to {maximum}")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        fail(name, value, expected, fix, error=TypeError)
    v = int(value)
    if (minimum is not None and v < minimum) or (maximum is not None and v > maximum):
        fail(name, value, expected, fix)
    return v


def check_number(name: str, value: Any, *, low: float | None = None,
                 high: float | None = None, low_open: bool = False, high_open: bool = False,
                 fix: str = "") -> float:
    """``value`` as a finite float within the bounds (bools, NaN and infinities refused).

    Args:
        name: the argument's name.
        value: what was received.
        low, high: bounds (None: unbounded).
        low_open, high_open: exclude the bound itself.
        fix: how to fix a bad value.

    Raises:
        TypeError: not a real number (or a bool). ValueError: NaN, infinite or out of bounds.

    Example:
        >>> check_number("validation_split", 0.2, low=0, high=1, high_open=True)
        0.2
    """
    parts = ["finite"]
    if low is not None:
        parts.append(f"{'>' if low_open else '>='} {low:g}")
    if high is not None:
        parts.append(f"{'<' if high_open else '<='} {high:g}")
    expected = "a " + (" number ".join([parts[0], " and ".join(parts[1:])]) if parts[1:]
                       else "finite number")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        fail(name, value, expected, fix, error=TypeError)
    v = float(value)
    ok = math.isfinite(v)
    if ok and low is not None:
        ok = v > low if low_open else v >= low
    if ok and high is not None:
        ok = v < high if high_open else v <= high
    if not ok:
        fail(name, value, expected, fix)
    return v


def check_choice(name: str, value: Any, choices: Collection[Any], fix: str = "") -> Any:
    """``value`` if it is one of ``choices``.

    Raises:
        ValueError: naming the choices.

    Example:
        >>> check_choice("precision", "32", ("32", "bf16-mixed"))
        '32'
    """
    try:
        if value in choices and not isinstance(value, bool):
            return value
    except (TypeError, ValueError):  # unhashable against a set; an array's == is per element
        pass
    fail(name, value, "one of " + ", ".join(repr(c) for c in choices), fix)


def check_bool(name: str, value: Any, fix: str = "") -> bool:
    """``value`` if it is a Python bool: a flag given ``"no"``, ``1`` or an array is a
    TypeError, never read as truthy (``async_save="no"`` must not turn async saving on).

    Example:
        >>> check_bool("async_save", False)
        False
    """
    if isinstance(value, bool):
        return value
    fail(name, value, "True or False", fix, error=TypeError)


def check_folder(name: str, path: str, fix: str = "") -> str:
    """``path`` as a folder that can be made and written into: neither it nor a folder above
    it is a file, and the nearest existing folder is writable (checked before a call
    changes anything, so a bad path is not found at the first save).

    Raises:
        ValueError: naming the file in the way, or the folder that cannot be written.

    Example:
        >>> check_folder("CSVLogger(filename=...)", "runs")
        'runs'
    """
    whole = os.path.abspath(path)
    probe = whole
    while not os.path.isdir(probe):
        if os.path.lexists(probe):
            where = "is a file" if probe == whole else f"is under {probe!r}, a file"
            fail(name, f"{path!r}, which {where}", "a folder, or a path where one can be "
                 "made", fix or "pass a path whose folders are folders (remove or rename "
                 "the file)", described=True)
        parent = os.path.dirname(probe)
        if parent == probe:
            return path
        probe = parent
    if not os.access(probe, os.W_OK | os.X_OK):
        fail(name, f"{path!r}, under {probe!r}, which this process cannot write to",
             "a folder this process can write", fix or "pass a writable path",
             described=True)
    return path


def check_file_target(name: str, path: str, fix: str = "") -> str:
    """``path`` as a file to write later: not a folder, and its folder can be made
    (``check_folder``).

    Example:
        >>> check_file_target("CSVLogger(filename=...)", "runs/log.csv")
        'runs/log.csv'
    """
    if os.path.isdir(path):
        fail(name, f"{path!r}, a folder", "a file, not a folder", fix or "name a file inside "
             "it", described=True)
    check_folder(name, os.path.dirname(path) or ".", fix)
    return path


def check_path_arg(name: str, path: Any, example: str) -> str:
    """``path`` as a non-empty string (a file or folder a callback writes later): a
    TypeError naming ``name`` otherwise, with ``example`` as the fix.

    Example:
        >>> check_path_arg("BackupAndRestore(backup_dir=...)", "runs/backup", "'runs/backup'")
        'runs/backup'
    """
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        fail(name, path, f"a non-empty path such as {example}", error=TypeError)
    return os.fspath(path)


def check_path(name: str, path: Any, *, must_exist: bool = False) -> str:
    """``path`` as a string naming a regular file (existing or to be written).

    A FIFO, socket or device is refused rather than opened (opening a FIFO waits forever for
    a writer), and so is a folder.

    Raises:
        TypeError: not a ``str`` or ``os.PathLike``. ValueError: empty, a folder or a special
            file. FileNotFoundError: ``must_exist`` and nothing is there.

    Example:
        >>> check_path("path", "model.ckpt")
        'model.ckpt'
    """
    if not isinstance(path, (str, os.PathLike)):
        fail(name, path, "a file path (str or os.PathLike)", error=TypeError)
    text = os.fspath(path)
    if not isinstance(text, str) or not text:
        fail(name, path, "a non-empty file path")
    try:
        mode = os.stat(text).st_mode
    except FileNotFoundError:
        if must_exist:
            raise FileNotFoundError(f"{name}: no file at {text!r}") from None
        return text
    except OSError:
        return text  # unreadable metadata: let the open itself report it
    # The whole path in the message: a cut one would lose the file name, what matters most.
    if stat.S_ISDIR(mode):
        fail(name, f"{text!r}, a folder", "a file, not a folder", "name a file inside it, "
             f"e.g. {os.path.join(text, 'model.ckpt')!r}", described=True)
    if not stat.S_ISREG(mode):
        fail(name, f"{text!r}, {_special_kind(mode)}",
             "a regular file, not a FIFO, socket or device", "pass the path of a regular file",
             described=True)
    return text


def _special_kind(mode: int) -> str:
    """What a special file is, in words."""
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a special file"


def closest(name: str, names: Iterable[str]) -> str | None:
    """The one of ``names`` that ``name`` is likely a misspelling of (``atention_mask`` of
    ``attention_mask``: difflib's ratio at least 0.8), or None."""
    found = difflib.get_close_matches(name, list(names), n=1, cutoff=0.8)
    return found[0] if found else None


_SIGNATURES: weakref.WeakKeyDictionary[Any, inspect.Signature | None] = \
    weakref.WeakKeyDictionary()


def forward_signature(module: Any) -> inspect.Signature | None:
    """``inspect.signature(module.forward)`` (None when it has none to read), read once per
    forward function: every call checks its first batch against it, and reading it costs
    tens of microseconds. Kept by the function (the class's ``forward``, or one set on the
    instance), so another forward is read anew."""
    forward = module.forward
    func = getattr(forward, "__func__", None)
    bound = func is not None and getattr(forward, "__self__", None) is module
    key = func if bound else forward
    try:
        return _SIGNATURES[key]
    except KeyError:
        pass
    except TypeError:  # neither hashable nor weakly referable: read every time
        return _signature(forward)
    found = _SIGNATURES[key] = _signature(forward)
    return found


def _signature(forward: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(forward)
    except (TypeError, ValueError):
        return None
