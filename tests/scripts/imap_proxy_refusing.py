#!/usr/bin/env python3
"""imap_proxy.py, refusing more (tests/imap_mailbox_test.cpp).

    imap_proxy_refusing.py --to HOST:PORT [--refuse-search]
                           [--refuse-expunge FILE] [imap_proxy.py's flags]

As imap_proxy.py, and besides, what a client sends is rewritten so that the
server refuses it:

  --refuse-search        "TAG UID SEARCH HEADER ..." sent as "TAG UID SEARCH
                         CHARSET X-REFUSED HEADER ...": the server answers
                         NO [BADCHARSET], as Exchange Online does to a
                         search that is not US-ASCII
  --refuse-expunge FILE  while FILE exists, "TAG UID EXPUNGE ..." sent as
                         "TAG STATUS "x-refused-expunge" (MESSAGES)": the
                         server answers NO (no such mailbox), as a server
                         throttling the client might
"""
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import imap_proxy  # noqa: E402

SEARCH = re.compile(rb"^(\S+ UID SEARCH )(?=[^\r\n]*HEADER )", re.IGNORECASE)
EXPUNGE = re.compile(rb"^(\S+) UID EXPUNGE [^\r\n]*", re.IGNORECASE)
pump = imap_proxy.pump
refuse_search = "--refuse-search" in sys.argv
refuse_expunge = None
if refuse_search:
    sys.argv.remove("--refuse-search")
if "--refuse-expunge" in sys.argv:
    at = sys.argv.index("--refuse-expunge")
    refuse_expunge = sys.argv[at + 1]
    del sys.argv[at:at + 2]


def refuse(line):
    # Both directions: only a client's command has "UID SEARCH" or "UID EXPUNGE" as its second and third words.
    if refuse_search:
        line = SEARCH.sub(rb"\1CHARSET X-REFUSED ", line)
    if refuse_expunge and os.path.exists(refuse_expunge):
        line = EXPUNGE.sub(rb'\1 STATUS "x-refused-expunge" (MESSAGES)', line)
    return line


async def refusing_pump(reader, writer, on_line):
    await pump(reader, writer, lambda line: refuse(on_line(line)))


imap_proxy.pump = refusing_pump

if __name__ == "__main__":
    sys.exit(imap_proxy.main())
