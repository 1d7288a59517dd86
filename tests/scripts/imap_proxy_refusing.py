#!/usr/bin/env python3
"""imap_proxy.py, refusing more (tests/imap_mailbox_test.cpp).

    imap_proxy_refusing.py --to HOST:PORT [imap_proxy.py's flags]

As imap_proxy.py, and besides, what a client sends is rewritten so that the
server refuses it:

  "TAG UID SEARCH HEADER ..."  sent as "TAG UID SEARCH CHARSET X-REFUSED
                               HEADER ...": the server answers NO
                               [BADCHARSET], as Exchange Online does to a
                               search that is not US-ASCII
"""
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import imap_proxy  # noqa: E402

SEARCH = re.compile(rb"^(\S+ UID SEARCH )(HEADER )", re.IGNORECASE)
pump = imap_proxy.pump


async def refusing_pump(reader, writer, on_line):
    # Both directions: only a client's command has "UID SEARCH" as its second and third words.
    await pump(reader, writer, lambda line: SEARCH.sub(rb"\1CHARSET X-REFUSED \2", on_line(line)))


imap_proxy.pump = refusing_pump

if __name__ == "__main__":
    sys.exit(imap_proxy.main())
