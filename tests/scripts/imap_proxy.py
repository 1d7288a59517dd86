#!/usr/bin/env python3
"""A fault-injecting IMAP proxy for dibs's tests (tests/imap_mailbox_test.cpp).

    imap_proxy.py --to HOST:PORT [--no-star] [--no-move] [--no-qresync] [--log FILE]

Listens on a free port of 127.0.0.1 and prints it (one line, then flushes),
and passes every connection through to the IMAP server at HOST:PORT, byte
for byte, except for the lines it rewrites. Only what the server says is
rewritten, only at the start of a response (never inside a literal, nor in
the rest of a line after one), and only these:

  --no-star  "* OK [PERMANENTFLAGS (...)]": \\* taken out, as a server that
             keeps no keywords of the client's says (Exchange Online)
  --no-move  "* CAPABILITY ...", "* OK [CAPABILITY ...]" and
             "TAG OK [CAPABILITY ...]": MOVE taken out, as a server without
             RFC 6851 says
  --no-qresync the same lines: QRESYNC and CONDSTORE taken out, as Exchange
             Online's say (with --no-star: a server like Exchange's IMAP)

--log FILE: the name of each command a client sends ("SELECT", "UID MOVE"),
one a line, appended to FILE; never its arguments (LOGIN's are a password).

Literals ({n} and {n+}, RFC 3501 and 7888) are passed through whole in both
directions: APPEND's from the client, FETCH's from the server. Runs until it
is killed.
"""
import argparse
import asyncio
import re
import sys

MAX_LINE = 1 << 27  # a message fetched whole is one line: as big as the client's max_line and more
LITERAL = re.compile(rb"\{(\d+)\+?\}\r?\n$")
CAPABILITY = re.compile(rb"^\S+ (?:OK \[)?CAPABILITY ", re.IGNORECASE)
MOVE = re.compile(rb" MOVE(?=[ \]\r\n])", re.IGNORECASE)
QRESYNC = re.compile(rb" (?:QRESYNC|CONDSTORE)(?=[ \]\r\n])", re.IGNORECASE)


def rewrite(line, args):
    if args.no_star and line.upper().startswith(b"* OK [PERMANENTFLAGS "):
        line = line.replace(b" \\*", b"").replace(b"(\\* ", b"(").replace(b"(\\*)", b"()")
    if args.no_move and CAPABILITY.match(line):
        line = MOVE.sub(b"", line)
    if args.no_qresync and CAPABILITY.match(line):
        line = QRESYNC.sub(b"", line)
    return line


def command_name(line):
    words = line.split(None, 3)
    if len(words) < 2:
        return None  # IDLE's DONE, say
    name = words[1].upper()
    if name == b"UID" and len(words) > 2:
        name += b" " + words[2].upper()
    return name.decode("ascii", "replace")


async def pump(reader, writer, on_line):
    """Copies reader to writer; on_line(line) may rewrite each line that
    starts a command or a response (not a literal, nor the rest of a line
    after one)."""
    try:
        after_literal = False
        while True:
            line = await reader.readuntil(b"\n")
            if not after_literal:
                line = on_line(line)
            writer.write(line)
            literal = LITERAL.search(line)
            if literal:
                writer.write(await reader.readexactly(int(literal.group(1))))
            after_literal = literal is not None
            await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, OSError):
        pass
    finally:
        writer.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--to", required=True, help="HOST:PORT of the IMAP server")
    parser.add_argument("--no-star", action="store_true", help="take \\* out of PERMANENTFLAGS")
    parser.add_argument("--no-move", action="store_true", help="take MOVE out of CAPABILITY")
    parser.add_argument("--no-qresync", action="store_true", help="take QRESYNC and CONDSTORE out of CAPABILITY")
    parser.add_argument("--log", help="append the name of each command a client sends to this file")
    args = parser.parse_args()
    host, _, port = args.to.rpartition(":")
    log = open(args.log, "a", encoding="ascii") if args.log else None

    def from_client(line):
        if log:
            name = command_name(line)
            if name:
                log.write(name + "\n")
                log.flush()
        return line

    async def connection(client_reader, client_writer):
        try:
            server_reader, server_writer = await asyncio.open_connection(host, int(port), limit=MAX_LINE)
        except OSError:  # the server is down (a test killed it): as if it refused the client
            client_writer.close()
            return
        await asyncio.gather(pump(client_reader, server_writer, from_client),
                             pump(server_reader, client_writer, lambda line: rewrite(line, args)))

    async def serve():
        server = await asyncio.start_server(connection, "127.0.0.1", 0, limit=MAX_LINE)
        print(server.sockets[0].getsockname()[1], flush=True)
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


if __name__ == "__main__":
    sys.exit(main())
