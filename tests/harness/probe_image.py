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

# ``/probe echo TEXT | exit N | sleep N | net | env NAME | cat PATH``, steps run in order;
# ``cat`` prints ``PATH=<first line>`` or ``PATH=(absent)``.
PROBE_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "echo") == 0 && i + 1 < argc) { puts(argv[++i]); fflush(stdout); }
        else if (strcmp(argv[i], "err") == 0 && i + 1 < argc) { fprintf(stderr, "%s\n", argv[++i]); }
        else if (strcmp(argv[i], "exit") == 0 && i + 1 < argc) return atoi(argv[++i]);
        else if (strcmp(argv[i], "sleep") == 0 && i + 1 < argc) sleep((unsigned)atoi(argv[++i]));
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
