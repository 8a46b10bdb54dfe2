"""The one lock-file primitive: an exclusive flock on a file that its holder may remove when done (so that nothing is
left in a user's directory), for `openrlhf-geo model`'s conversion lock and a run directory's lock (local.rundir)."""

import errno
import fcntl
import os


def lock(path, blocking=True):
    """(open handle, created by this call) of the lock file `path`, exclusively flock-ed, and the very file `path`
    names when this returns: a holder that removed the file after this process opened it leaves a lock on nothing,
    so the lock is taken again on the file now at `path`. Not `blocking`: BlockingIOError when another process
    holds it; any other OSError when the file cannot be used (a directory, a link to nothing, no permission)."""
    while True:
        try:
            handle, new = open(path, "x+"), True
        except FileExistsError:
            try:
                handle, new = open(path, "r+"), False
            except FileNotFoundError:  # removed in between: create it
                if os.path.islink(
                    path
                ):  # a link to nothing: "x+" fails on it forever; "a" would write where it points
                    raise FileNotFoundError(errno.ENOENT, "a symbolic link to nothing", str(path)) from None
                continue
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BaseException:
            handle.close()
            raise
        try:
            if os.path.samestat(os.fstat(handle.fileno()), os.stat(path)):
                return handle, new
        except FileNotFoundError:
            pass
        handle.close()
