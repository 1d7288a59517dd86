#!/usr/bin/env python3
"""Lists folders of the tests' IMAP account with Python's imaplib: a second
client, not dibs's, to check what dibs's tests expect (tests/imap_mailbox_test.cpp).

    imap_list.py ENV FOLDER...

ENV: the file scripts/imap.sh writes (DIBS_IMAP_HOST, DIBS_IMAP_PORT,
DIBS_IMAP_USER, DIBS_IMAP_PASSWORD): the password is read from it, never
given on the command line. For each FOLDER: LOGIN, SELECT, SEARCH ALL, and
FETCH of each message's Message-ID and flags; prints one line per message:

    FOLDER<TAB>MESSAGE-ID<TAB>FLAGS

(MESSAGE-ID "-" if it has none; FLAGS as the server gave them, space
separated). Exits 1 with the server's words if a command fails.
"""
import imaplib
import re
import sys


def quoted(name):
    return '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    env = {}
    with open(sys.argv[1], encoding="utf-8") as f:
        for line in f:
            key, sep, value = line.rstrip("\n").partition("=")
            if sep:
                env[key] = value
    imap = imaplib.IMAP4(env["DIBS_IMAP_HOST"], int(env["DIBS_IMAP_PORT"]))
    imap.login(env["DIBS_IMAP_USER"], env["DIBS_IMAP_PASSWORD"])
    for folder in sys.argv[2:]:
        status, data = imap.select(quoted(folder))
        if status != "OK":
            sys.exit(f"SELECT {folder}: {status} {data}")
        status, data = imap.search(None, "ALL")
        if status != "OK":
            sys.exit(f"SEARCH ALL in {folder}: {status} {data}")
        for number in data[0].split():
            status, parts = imap.fetch(number, "(FLAGS BODY.PEEK[HEADER.FIELDS (MESSAGE-ID)])")
            if status != "OK":
                sys.exit(f"FETCH {number} in {folder}: {status} {parts}")
            head, header = b"", b""
            for part in parts:
                if isinstance(part, tuple):
                    head, header = head + part[0], header + part[1]
                else:
                    head += part
            flags = re.search(rb"FLAGS \(([^)]*)\)", head)
            found = re.search(rb"Message-ID:\s*(\S+)", header, re.IGNORECASE)
            print("\t".join([folder,
                             found.group(1).decode("ascii", "replace") if found else "-",
                             flags.group(1).decode("ascii", "replace") if flags else ""]))
    imap.logout()


if __name__ == "__main__":
    main()
