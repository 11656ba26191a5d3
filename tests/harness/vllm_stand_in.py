"""A small local image standing in for vLLM's (no pull, no Python: one static C program on
an empty root), for the ``vllm`` runtime's tests.

It takes vLLM's own arguments (``--model DIR --served-model-name NAME --host H --port P
[--max-model-len N]``), prints a line, listens on H:P and answers ``GET /v1/models`` as
vLLM's OpenAI server does, naming the served model. ``GET /probe`` says what the process
could do (its uid, whether it could write into the model directory, what it lists there,
its arguments); ``--stand-in-exit N`` makes it print a line and exit with N instead of
serving.
"""

from __future__ import annotations

import io
import secrets
import shutil
import subprocess
import tarfile
from pathlib import Path

from .control_plane import unavailable
from .probe_image import TestImage

STAND_IN_C = r"""
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static char body[16384];

int main(int argc, char **argv) {
    const char *name = "?", *host = "127.0.0.1", *model = "/model";
    int port = 8000, max_len = 0;
    for (int i = 1; i + 1 < argc; i++) {
        if (!strcmp(argv[i], "--served-model-name")) name = argv[++i];
        else if (!strcmp(argv[i], "--host")) host = argv[++i];
        else if (!strcmp(argv[i], "--port")) port = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--model")) model = argv[++i];
        else if (!strcmp(argv[i], "--max-model-len")) max_len = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--stand-in-exit")) {
            printf("stand-in exiting with %s\n", argv[i + 1]);
            fflush(stdout);
            return atoi(argv[i + 1]);
        }
    }
    int server = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(server, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in address = {0};
    address.sin_family = AF_INET;
    address.sin_port = htons((unsigned short)port);
    inet_pton(AF_INET, host, &address.sin_addr);
    if (bind(server, (struct sockaddr *)&address, sizeof address) || listen(server, 16)) {
        printf("stand-in cannot listen on %s:%d: %s\n", host, port, strerror(errno));
        return 1;
    }
    printf("stand-in vllm serving %s on %s:%d\n", name, host, port);
    fflush(stdout);
    for (;;) {
        int client = accept(server, NULL, NULL);
        if (client < 0) continue;
        char request[4096] = {0};
        ssize_t got = read(client, request, sizeof request - 1);
        const char *status = "200 OK";
        if (got > 0 && !strncmp(request, "GET /v1/models ", 15)) {
            snprintf(body, sizeof body,
                     "{\"object\": \"list\", \"data\": [{\"id\": \"%s\", \"object\": \"model\", "
                     "\"root\": \"%s\", \"max_model_len\": %d}]}", name, model, max_len);
        } else if (got > 0 && !strncmp(request, "GET /probe ", 11)) {
            char path[512];
            snprintf(path, sizeof path, "%s/written-by-the-runtime", model);
            int fd = open(path, O_WRONLY | O_CREAT, 0644);
            const char *write_result = fd >= 0 ? "ok" : strerror(errno);
            if (fd >= 0) close(fd);
            size_t n = (size_t)snprintf(body, sizeof body,
                "{\"uid\": %d, \"gid\": %d, \"model_write\": \"%s\", \"model_files\": [",
                (int)getuid(), (int)getgid(), write_result);
            DIR *dir = opendir(model);
            struct dirent *entry;
            int first = 1;
            while (dir && (entry = readdir(dir)) && n < sizeof body - 600) {
                if (entry->d_name[0] == '.') continue;
                n += (size_t)snprintf(body + n, sizeof body - n, "%s\"%s\"", first ? "" : ", ",
                                      entry->d_name);
                first = 0;
            }
            if (dir) closedir(dir);
            n += (size_t)snprintf(body + n, sizeof body - n, "], \"argv\": [");
            for (int i = 1; i < argc && n < sizeof body - 600; i++)
                n += (size_t)snprintf(body + n, sizeof body - n, "%s\"%s\"", i > 1 ? ", " : "",
                                      argv[i]);
            snprintf(body + n, sizeof body - n, "]}");
        } else {
            status = "404 Not Found";
            snprintf(body, sizeof body, "{\"error\": \"not found\"}");
        }
        char head[256];
        int length = snprintf(head, sizeof head,
                              "HTTP/1.1 %s\r\nContent-Type: application/json\r\n"
                              "Content-Length: %zu\r\nConnection: close\r\n\r\n",
                              status, strlen(body));
        write(client, head, (size_t)length);
        write(client, body, strlen(body));
        close(client);
    }
}
"""

DOCKERFILE = 'FROM scratch\nCOPY stand-in /stand-in\nENTRYPOINT ["/stand-in"]\n'


def build_vllm_stand_in(client, work: Path) -> TestImage:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        unavailable("no C compiler: scripts/test installs gcc and libc6-dev")
    source = work / "stand-in.c"
    source.write_text(STAND_IN_C)
    binary = work / "stand-in"
    subprocess.run([compiler, "-static", "-O1", "-o", str(binary), str(source)], check=True)
    context = io.BytesIO()
    with tarfile.open(fileobj=context, mode="w") as tar:
        tar.add(binary, arcname="stand-in")
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(DOCKERFILE)
        tar.addfile(info, io.BytesIO(DOCKERFILE.encode()))
    context.seek(0)
    tag = f"modelforge-test-vllm-stand-in-{secrets.token_hex(4)}:1"
    image, _ = client.images.build(
        fileobj=context, custom_context=True, tag=tag, pull=False, rm=True
    )
    return TestImage(tag, image.id)
