/*
 * A small CUDA-driver-compatible library for the worker's smoke tests, loaded by the
 * worker's ctypes code as libcuda.so.1 through LD_LIBRARY_PATH (see tests/nvml/fake_nvml.c
 * for its NVML twin). It reads the same FAKE_NVML_CONFIG file: every "device" line is a
 * CUDA device with its name and pci_bus_id, and "fail <cuCall> <CUresult>" lines (global,
 * or after a "device" line for that device only) make that call fail. The per-device key
 * "cuda_miscompute 1" makes the kernel get one element wrong.
 *
 * Device memory is host memory, and cuLaunchKernel performs the one kernel the worker
 * loads (saxpy: y = a*x + y) on the host, reading its parameters exactly as the driver
 * would: kernelParams[i] points at the i-th argument. The PTX text is not compiled, but
 * checked as far as a real driver's JIT would refuse it with CUDA_ERROR_INVALID_PTX: it
 * starts with a .version directive, holds the saxpy entry point, and nothing but white
 * space follows its last closing brace (a stray "\0" written as two characters there was
 * accepted here and refused by an H200's driver 580).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct { int device; } context_t;
typedef context_t *CUcontext;
typedef struct { int loaded; } module_t;
typedef module_t *CUmodule;
typedef struct { int saxpy; } function_t;
typedef function_t *CUfunction;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_NO_DEVICE 100
#define CUDA_ERROR_INVALID_DEVICE 101
#define CUDA_ERROR_INVALID_CONTEXT 201
#define CUDA_ERROR_INVALID_PTX 218
#define CUDA_ERROR_NOT_FOUND 500
#define CUDA_ERROR_LAUNCH_FAILED 719

#define MAX_DEVICES 64
#define MAX_FAILS 32
#define TEXT 96

typedef struct { char call[TEXT]; int code; } fail_t;
typedef struct {
    char name[TEXT];
    char pci_bus_id[32];
    int miscompute;
    fail_t fails[MAX_FAILS];
    int nfails;
} device_t;

static device_t devices[MAX_DEVICES];
static int ndevices;
static fail_t global_fails[MAX_FAILS];
static int nglobal_fails;
static int initialised;
static int current = -1; /* the device of the current context */

static void add_fail(fail_t *table, int *count, const char *value) {
    if (*count >= MAX_FAILS) return;
    fail_t *entry = &table[(*count)++];
    if (sscanf(value, "%95s %d", entry->call, &entry->code) != 2 || strncmp(entry->call, "cu", 2) != 0)
        (*count)--;
}

static int load_config(void) {
    const char *path = getenv("FAKE_NVML_CONFIG");
    FILE *in = (path != NULL && *path != '\0') ? fopen(path, "r") : NULL;
    if (in == NULL) return 0;
    ndevices = nglobal_fails = 0;
    char line[512];
    while (fgets(line, sizeof line, in) != NULL) {
        line[strcspn(line, "\r\n")] = '\0';
        char *value = strchr(line, ' ');
        if (value != NULL) *value++ = '\0';
        else value = line + strlen(line);
        if (strcmp(line, "device") == 0) {
            if (ndevices < MAX_DEVICES) memset(&devices[ndevices++], 0, sizeof(device_t));
        } else if (ndevices > 0) {
            device_t *d = &devices[ndevices - 1];
            if (strcmp(line, "name") == 0) snprintf(d->name, sizeof d->name, "%s", value);
            else if (strcmp(line, "pci_bus_id") == 0) snprintf(d->pci_bus_id, sizeof d->pci_bus_id, "%s", value);
            else if (strcmp(line, "cuda_miscompute") == 0) d->miscompute = atoi(value);
            else if (strcmp(line, "fail") == 0) add_fail(d->fails, &d->nfails, value);
        } else if (strcmp(line, "fail") == 0) {
            add_fail(global_fails, &nglobal_fails, value);
        }
    }
    fclose(in);
    return 1;
}

static int failure_of(const char *call, int device) {
    for (int i = 0; i < nglobal_fails; i++)
        if (strcmp(global_fails[i].call, call) == 0) return global_fails[i].code;
    if (device >= 0 && device < ndevices)
        for (int i = 0; i < devices[device].nfails; i++)
            if (strcmp(devices[device].fails[i].call, call) == 0) return devices[device].fails[i].code;
    return CUDA_SUCCESS;
}

#define ENTER(name, device)                                     \
    do {                                                        \
        if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;    \
        int failure_ = failure_of(name, device);                \
        if (failure_ != CUDA_SUCCESS) return failure_;          \
    } while (0)

CUresult cuGetErrorName(CUresult error, const char **name) {
    switch (error) {
    case CUDA_SUCCESS: *name = "CUDA_SUCCESS"; break;
    case CUDA_ERROR_INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; break;
    case CUDA_ERROR_NOT_INITIALIZED: *name = "CUDA_ERROR_NOT_INITIALIZED"; break;
    case CUDA_ERROR_NO_DEVICE: *name = "CUDA_ERROR_NO_DEVICE"; break;
    case CUDA_ERROR_INVALID_DEVICE: *name = "CUDA_ERROR_INVALID_DEVICE"; break;
    case CUDA_ERROR_INVALID_CONTEXT: *name = "CUDA_ERROR_INVALID_CONTEXT"; break;
    case CUDA_ERROR_INVALID_PTX: *name = "CUDA_ERROR_INVALID_PTX"; break;
    case CUDA_ERROR_NOT_FOUND: *name = "CUDA_ERROR_NOT_FOUND"; break;
    case CUDA_ERROR_LAUNCH_FAILED: *name = "CUDA_ERROR_LAUNCH_FAILED"; break;
    default: *name = NULL; return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

CUresult cuInit(unsigned int flags) {
    (void)flags;
    if (!load_config()) return CUDA_ERROR_NO_DEVICE;
    int failure = failure_of("cuInit", -1);
    if (failure != CUDA_SUCCESS) return failure;
    initialised = 1;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
    ENTER("cuDeviceGetCount", -1);
    *count = ndevices;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    ENTER("cuDeviceGet", ordinal);
    if (ordinal < 0 || ordinal >= ndevices) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char *name, int length, CUdevice device) {
    ENTER("cuDeviceGetName", device);
    if (device < 0 || device >= ndevices) return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)length, "%s", devices[device].name);
    return CUDA_SUCCESS;
}

/* NVML says 00000000:18:00.0; the driver API says 0000:18:00.0. */
CUresult cuDeviceGetPCIBusId(char *bus, int length, CUdevice device) {
    ENTER("cuDeviceGetPCIBusId", device);
    if (device < 0 || device >= ndevices) return CUDA_ERROR_INVALID_DEVICE;
    const char *id = devices[device].pci_bus_id;
    snprintf(bus, (size_t)length, "%s", strlen(id) == 16 ? id + 4 : id);
    return CUDA_SUCCESS;
}

CUresult cuCtxCreate_v2(CUcontext *context, unsigned int flags, CUdevice device) {
    (void)flags;
    ENTER("cuCtxCreate_v2", device);
    if (device < 0 || device >= ndevices) return CUDA_ERROR_INVALID_DEVICE;
    *context = malloc(sizeof(context_t));
    (*context)->device = device;
    current = device;
    return CUDA_SUCCESS;
}

CUresult cuCtxDestroy_v2(CUcontext context) {
    if (context == NULL) return CUDA_ERROR_INVALID_CONTEXT;
    if (current == context->device) current = -1;
    free(context);
    return CUDA_SUCCESS;
}

CUresult cuCtxSynchronize(void) {
    ENTER("cuCtxSynchronize", current);
    return current < 0 ? CUDA_ERROR_INVALID_CONTEXT : CUDA_SUCCESS;
}

static int plausible_ptx(const char *text) {
    if (text == NULL) return 0;
    const char *start = text + strspn(text, " \t\r\n");
    if (strncmp(start, ".version ", 9) != 0 || strstr(text, ".entry saxpy(") == NULL) return 0;
    const char *last = strrchr(text, '}');
    return last != NULL && last[1 + strspn(last + 1, " \t\r\n")] == '\0';
}

CUresult cuModuleLoadData(CUmodule *module, const void *image) {
    ENTER("cuModuleLoadData", current);
    if (current < 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (!plausible_ptx((const char *)image)) return CUDA_ERROR_INVALID_PTX;
    *module = malloc(sizeof(module_t));
    (*module)->loaded = 1;
    return CUDA_SUCCESS;
}

CUresult cuModuleUnload(CUmodule module) {
    if (module == NULL) return CUDA_ERROR_INVALID_VALUE;
    free(module);
    return CUDA_SUCCESS;
}

static function_t saxpy_function = {1};

CUresult cuModuleGetFunction(CUfunction *function, CUmodule module, const char *name) {
    ENTER("cuModuleGetFunction", current);
    if (module == NULL) return CUDA_ERROR_INVALID_VALUE;
    if (strcmp(name, "saxpy") != 0) return CUDA_ERROR_NOT_FOUND;
    *function = &saxpy_function;
    return CUDA_SUCCESS;
}

CUresult cuMemAlloc_v2(CUdeviceptr *pointer, size_t size) {
    ENTER("cuMemAlloc_v2", current);
    if (current < 0) return CUDA_ERROR_INVALID_CONTEXT;
    void *memory = malloc(size);
    if (memory == NULL) return CUDA_ERROR_INVALID_VALUE;
    *pointer = (CUdeviceptr)(uintptr_t)memory;
    return CUDA_SUCCESS;
}

CUresult cuMemFree_v2(CUdeviceptr pointer) {
    ENTER("cuMemFree_v2", current);
    free((void *)(uintptr_t)pointer);
    return CUDA_SUCCESS;
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr destination, const void *source, size_t size) {
    ENTER("cuMemcpyHtoD_v2", current);
    memcpy((void *)(uintptr_t)destination, source, size);
    return CUDA_SUCCESS;
}

CUresult cuMemcpyDtoH_v2(void *destination, CUdeviceptr source, size_t size) {
    ENTER("cuMemcpyDtoH_v2", current);
    memcpy(destination, (const void *)(uintptr_t)source, size);
    return CUDA_SUCCESS;
}

CUresult cuLaunchKernel(CUfunction function, unsigned int gx, unsigned int gy, unsigned int gz,
                        unsigned int bx, unsigned int by, unsigned int bz, unsigned int shared,
                        void *stream, void **params, void **extra) {
    (void)gy; (void)gz; (void)by; (void)bz; (void)shared; (void)stream; (void)extra;
    ENTER("cuLaunchKernel", current);
    if (current < 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (function != &saxpy_function || params == NULL) return CUDA_ERROR_INVALID_VALUE;
    unsigned int n = *(unsigned int *)params[0];
    float a = *(float *)params[1];
    float *x = (float *)(uintptr_t)*(CUdeviceptr *)params[2];
    float *y = (float *)(uintptr_t)*(CUdeviceptr *)params[3];
    unsigned long long threads = (unsigned long long)gx * bx;
    for (unsigned long long i = 0; i < threads && i < n; i++) y[i] = a * x[i] + y[i];
    if (devices[current].miscompute && n > 0) y[n / 2] += 1.0f;
    return CUDA_SUCCESS;
}
