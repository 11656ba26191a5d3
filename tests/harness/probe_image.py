"""A tiny image for the container capability: one static C program on an empty root."""

from __future__ import annotations

import io
import secrets
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

from .control_plane import unavailable

# ``/probe echo TEXT | exit N | sleep N | net | env NAME | cat PATH | id | status KEY |
# write PATH BYTES | fork N | spam N``, steps run in order. ``cat`` prints ``PATH=<first line>``
# or ``PATH=(absent)``; ``status`` the line of /proc/self/status that starts with KEY; ``write``
# ``write PATH=<bytes written> <ok or the error>``; ``fork`` starts N sleeping children and
# prints ``forked=<how many started> <ok or the error>``; ``spam`` writes N lines of 1 KiB.
PROBE_C = r"""
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "echo") == 0 && i + 1 < argc) { puts(argv[++i]); fflush(stdout); }
        else if (strcmp(argv[i], "err") == 0 && i + 1 < argc) { fprintf(stderr, "%s\n", argv[++i]); }
        else if (strcmp(argv[i], "exit") == 0 && i + 1 < argc) return atoi(argv[++i]);
        else if (strcmp(argv[i], "sleep") == 0 && i + 1 < argc) { fflush(stdout); sleep((unsigned)atoi(argv[++i])); }
        else if (strcmp(argv[i], "env") == 0 && i + 1 < argc) {
            const char *value = getenv(argv[++i]);
            printf("%s=%s\n", argv[i], value ? value : "(unset)");
        } else if (strcmp(argv[i], "cat") == 0 && i + 1 < argc) {
            const char *path = argv[++i];
            FILE *file = fopen(path, "r");
            char text[256] = "(absent)";
            if (file) {
                if (!fgets(text, sizeof text, file)) text[0] = '\0';
                text[strcspn(text, "\n")] = '\0';
                fclose(file);
            }
            printf("%s=%s\n", path, text);
        } else if (strcmp(argv[i], "id") == 0) {
            printf("uid=%d gid=%d\n", (int)getuid(), (int)getgid());
        } else if (strcmp(argv[i], "status") == 0 && i + 1 < argc) {
            const char *key = argv[++i];
            FILE *file = fopen("/proc/self/status", "r");
            char line[512];
            while (file && fgets(line, sizeof line, file))
                if (strncmp(line, key, strlen(key)) == 0) fputs(line, stdout);
            if (file) fclose(file);
        } else if (strcmp(argv[i], "write") == 0 && i + 2 < argc) {
            const char *path = argv[++i];
            long long want = atoll(argv[++i]), done = 0;
            static char block[65536];
            const char *how = "ok";
            int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
            if (fd < 0) how = strerror(errno);
            while (fd >= 0 && done < want) {
                long long chunk = want - done < (long long)sizeof block ? want - done : (long long)sizeof block;
                ssize_t n = write(fd, block, (size_t)chunk);
                if (n <= 0) { how = strerror(errno); break; }
                done += n;
            }
            if (fd >= 0) close(fd);
            printf("write %s=%lld %s\n", path, done, how);
        } else if (strcmp(argv[i], "fork") == 0 && i + 1 < argc) {
            int want = atoi(argv[++i]), started = 0;
            const char *how = "ok";
            while (started < want) {
                pid_t pid = fork();
                if (pid < 0) { how = strerror(errno); break; }
                if (pid == 0) { sleep(600); _exit(0); }
                started++;
            }
            printf("forked=%d %s\n", started, how);
        } else if (strcmp(argv[i], "spam") == 0 && i + 1 < argc) {
            int lines = atoi(argv[++i]);
            static char text[1025];
            memset(text, 'x', 1024);
            for (int n = 0; n < lines; n++) puts(text);
        } else if (strcmp(argv[i], "net") == 0) {
            FILE *dev = fopen("/proc/net/dev", "r");
            char line[512];
            int n = 0;
            while (dev && fgets(line, sizeof line, dev)) {
                char *colon = strchr(line, ':');
                if (++n <= 2 || !colon) continue;
                *colon = '\0';
                char *name = line;
                while (*name == ' ') name++;
                printf("interface %s\n", name);
            }
            if (dev) fclose(dev);
        }
    }
    return 0;
}
"""

DOCKERFILE = 'FROM scratch\nCOPY probe /probe\nENTRYPOINT ["/probe"]\n'


@dataclass(frozen=True)
class TestImage:
    tag: str
    id: str


def build_test_image(client, work: Path) -> TestImage:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        unavailable("no C compiler: scripts/test installs gcc and libc6-dev")
    source = work / "probe.c"
    source.write_text(PROBE_C)
    subprocess.run([compiler, "-static", "-O1", "-o", str(work / "probe"), str(source)], check=True)
    context = io.BytesIO()
    with tarfile.open(fileobj=context, mode="w") as tar:
        tar.add(work / "probe", arcname="probe")
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(DOCKERFILE)
        tar.addfile(info, io.BytesIO(DOCKERFILE.encode()))
    context.seek(0)
    tag = f"modelforge-test-probe-{secrets.token_hex(4)}:1"
    image, _ = client.images.build(
        fileobj=context, custom_context=True, tag=tag, pull=False, rm=True
    )
    return TestImage(tag, image.id)
