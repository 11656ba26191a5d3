/*
 * A small NVML-compatible library for the agent tests, loaded by the real pynvml
 * bindings as libnvidia-ml.so.1 through LD_LIBRARY_PATH.
 *
 * Behaviour comes from the file named by FAKE_NVML_CONFIG, which the tests derive
 * from the JSON fixtures under tests/agent/fixtures/ (see tests/harness/nvml.py):
 *
 *   driver_version 550.54.15        system values
 *   cuda_version 12040
 *   fail nvmlInitWithFlags 9        before any "device": a call that fails everywhere
 *   device                          starts the next GPU (index 0, 1, ...)
 *   name NVIDIA H100 80GB HBM3      its values ...
 *   fail nvmlDeviceGetPowerUsage 3  after "device": a call that fails for this GPU
 *
 * A value that is absent makes its call answer NVML_ERROR_NOT_SUPPORTED.
 * When FAKE_NVML_CALL_LOG names a file, every call appends its name there, so a test
 * can prove that a mode never touched NVML.
 *
 * The structures match pynvml's ctypes layouts exactly (nvmlMemory_t,
 * nvmlPciInfo_t, nvmlUtilization_t).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int nvmlReturn_t;
#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_DRIVER_NOT_LOADED 9
#define NVML_ERROR_UNKNOWN 999

#define MAX_DEVICES 64
#define MAX_FAILS 64
#define TEXT 96

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

typedef struct {
    char call[TEXT];
    int code;
} fail_t;

typedef struct {
    char name[TEXT];
    char uuid[TEXT];
    char pci_bus_id[32];
    unsigned int pci_domain, pci_bus, pci_device, pci_device_id, pci_subsystem_id;
    unsigned long long memory_total, memory_used;
    long long util_gpu, util_memory, temperature, power_mw, power_limit_mw;
    long long clock_sm, clock_mem, mig;
    int has_memory;
    fail_t fails[MAX_FAILS];
    int nfails;
} device_t;

typedef device_t *nvmlDevice_t;

static device_t devices[MAX_DEVICES];
static int ndevices;
static fail_t global_fails[MAX_FAILS];
static int nglobal_fails;
static char driver_version[TEXT];
static long long cuda_version = -1;
static int initialised;

static void log_call(const char *name) {
    const char *path = getenv("FAKE_NVML_CALL_LOG");
    if (path == NULL || *path == '\0') return;
    FILE *out = fopen(path, "a");
    if (out == NULL) return;
    fprintf(out, "%s\n", name);
    fclose(out);
}

static void add_fail(fail_t *table, int *count, const char *value) {
    if (*count >= MAX_FAILS) return;
    fail_t *entry = &table[(*count)++];
    if (sscanf(value, "%95s %d", entry->call, &entry->code) != 2) (*count)--;
}

static int failure_of(const char *call, const device_t *device) {
    for (int i = 0; i < nglobal_fails; i++)
        if (strcmp(global_fails[i].call, call) == 0) return global_fails[i].code;
    if (device != NULL)
        for (int i = 0; i < device->nfails; i++)
            if (strcmp(device->fails[i].call, call) == 0) return device->fails[i].code;
    return NVML_SUCCESS;
}

static void copy_text(char *dest, size_t size, const char *value) {
    strncpy(dest, value, size - 1);
    dest[size - 1] = '\0';
}

static void new_device(void) {
    if (ndevices >= MAX_DEVICES) return;
    device_t *d = &devices[ndevices++];
    memset(d, 0, sizeof(*d));
    d->util_gpu = d->util_memory = d->temperature = d->power_mw = -1;
    d->power_limit_mw = d->clock_sm = d->clock_mem = d->mig = -1;
}

static void set_device_value(device_t *d, const char *key, const char *value) {
    if (strcmp(key, "name") == 0) copy_text(d->name, sizeof d->name, value);
    else if (strcmp(key, "uuid") == 0) copy_text(d->uuid, sizeof d->uuid, value);
    else if (strcmp(key, "pci_bus_id") == 0) copy_text(d->pci_bus_id, sizeof d->pci_bus_id, value);
    else if (strcmp(key, "pci_domain") == 0) d->pci_domain = (unsigned)strtoul(value, NULL, 0);
    else if (strcmp(key, "pci_bus") == 0) d->pci_bus = (unsigned)strtoul(value, NULL, 0);
    else if (strcmp(key, "pci_device") == 0) d->pci_device = (unsigned)strtoul(value, NULL, 0);
    else if (strcmp(key, "pci_device_id") == 0) d->pci_device_id = (unsigned)strtoul(value, NULL, 0);
    else if (strcmp(key, "pci_subsystem_id") == 0) d->pci_subsystem_id = (unsigned)strtoul(value, NULL, 0);
    else if (strcmp(key, "memory_total") == 0) { d->memory_total = strtoull(value, NULL, 10); d->has_memory = 1; }
    else if (strcmp(key, "memory_used") == 0) d->memory_used = strtoull(value, NULL, 10);
    else if (strcmp(key, "util_gpu") == 0) d->util_gpu = strtoll(value, NULL, 10);
    else if (strcmp(key, "util_memory") == 0) d->util_memory = strtoll(value, NULL, 10);
    else if (strcmp(key, "temperature") == 0) d->temperature = strtoll(value, NULL, 10);
    else if (strcmp(key, "power_mw") == 0) d->power_mw = strtoll(value, NULL, 10);
    else if (strcmp(key, "power_limit_mw") == 0) d->power_limit_mw = strtoll(value, NULL, 10);
    else if (strcmp(key, "clock_sm") == 0) d->clock_sm = strtoll(value, NULL, 10);
    else if (strcmp(key, "clock_mem") == 0) d->clock_mem = strtoll(value, NULL, 10);
    else if (strcmp(key, "mig") == 0) d->mig = strtoll(value, NULL, 10);
    else if (strcmp(key, "fail") == 0) add_fail(d->fails, &d->nfails, value);
}

static int load_config(void) {
    const char *path = getenv("FAKE_NVML_CONFIG");
    FILE *in = (path != NULL && *path != '\0') ? fopen(path, "r") : NULL;
    if (in == NULL) return 0;
    ndevices = nglobal_fails = 0;
    driver_version[0] = '\0';
    cuda_version = -1;
    char line[512];
    while (fgets(line, sizeof line, in) != NULL) {
        line[strcspn(line, "\r\n")] = '\0';
        char *value = strchr(line, ' ');
        if (value != NULL) *value++ = '\0';
        else value = line + strlen(line);
        if (strcmp(line, "device") == 0) new_device();
        else if (ndevices > 0) set_device_value(&devices[ndevices - 1], line, value);
        else if (strcmp(line, "driver_version") == 0) copy_text(driver_version, sizeof driver_version, value);
        else if (strcmp(line, "cuda_version") == 0) cuda_version = strtoll(value, NULL, 10);
        else if (strcmp(line, "fail") == 0) add_fail(global_fails, &nglobal_fails, value);
    }
    fclose(in);
    return 1;
}

/* Common prologue: log, require init, apply a configured failure. */
#define ENTER(name, device)                                     \
    do {                                                        \
        log_call(name);                                         \
        if (!initialised) return NVML_ERROR_UNINITIALIZED;      \
        int failure_ = failure_of(name, device);                \
        if (failure_ != NVML_SUCCESS) return failure_;          \
    } while (0)

static int valid(nvmlDevice_t device) {
    return device != NULL && device >= devices && device < devices + ndevices;
}

static nvmlReturn_t init(const char *name) {
    log_call(name);
    if (!load_config()) return NVML_ERROR_DRIVER_NOT_LOADED;
    int failure = failure_of(name, NULL);
    if (failure == NVML_SUCCESS) failure = failure_of("nvmlInit", NULL);
    if (failure != NVML_SUCCESS) return failure;
    initialised = 1;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) { (void)flags; return init("nvmlInitWithFlags"); }
nvmlReturn_t nvmlInit_v2(void) { return init("nvmlInit_v2"); }
nvmlReturn_t nvmlInit(void) { return init("nvmlInit"); }

nvmlReturn_t nvmlShutdown(void) {
    log_call("nvmlShutdown");
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    initialised = 0;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case 15: return "GPU is lost";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    ENTER("nvmlSystemGetDriverVersion", NULL);
    if (driver_version[0] == '\0') return NVML_ERROR_NOT_SUPPORTED;
    if (strlen(driver_version) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(version, driver_version);
    return NVML_SUCCESS;
}

static nvmlReturn_t cuda(const char *name, int *version) {
    ENTER(name, NULL);
    if (cuda_version < 0) return NVML_ERROR_NOT_SUPPORTED;
    *version = (int)cuda_version;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v) { return cuda("nvmlSystemGetCudaDriverVersion", v); }
nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) { return cuda("nvmlSystemGetCudaDriverVersion_v2", v); }

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    ENTER("nvmlDeviceGetCount_v2", NULL);
    *count = (unsigned int)ndevices;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    ENTER("nvmlDeviceGetHandleByIndex_v2", index < (unsigned)ndevices ? &devices[index] : NULL);
    if (index >= (unsigned)ndevices) return NVML_ERROR_INVALID_ARGUMENT;
    *device = &devices[index];
    return NVML_SUCCESS;
}

static nvmlReturn_t text(const char *name, nvmlDevice_t d, const char *value, char *out, unsigned int length) {
    ENTER(name, valid(d) ? d : NULL);
    if (!valid(d)) return NVML_ERROR_INVALID_ARGUMENT;
    if (value[0] == '\0') return NVML_ERROR_NOT_SUPPORTED;
    if (strlen(value) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(out, value);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned int length) {
    return text("nvmlDeviceGetName", d, valid(d) ? d->name : "", name, length);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned int length) {
    return text("nvmlDeviceGetUUID", d, valid(d) ? d->uuid : "", uuid, length);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *memory) {
    ENTER("nvmlDeviceGetMemoryInfo", valid(d) ? d : NULL);
    if (!valid(d)) return NVML_ERROR_INVALID_ARGUMENT;
    if (!d->has_memory) return NVML_ERROR_NOT_SUPPORTED;
    memory->total = d->memory_total;
    memory->used = d->memory_used;
    memory->free = d->memory_total > d->memory_used ? d->memory_total - d->memory_used : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t d, nvmlPciInfo_t *pci) {
    ENTER("nvmlDeviceGetPciInfo_v3", valid(d) ? d : NULL);
    if (!valid(d)) return NVML_ERROR_INVALID_ARGUMENT;
    memset(pci, 0, sizeof(*pci));
    copy_text(pci->busId, sizeof pci->busId, d->pci_bus_id);
    copy_text(pci->busIdLegacy, sizeof pci->busIdLegacy, d->pci_bus_id);
    pci->domain = d->pci_domain;
    pci->bus = d->pci_bus;
    pci->device = d->pci_device;
    pci->pciDeviceId = d->pci_device_id;
    pci->pciSubSystemId = d->pci_subsystem_id;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *utilization) {
    ENTER("nvmlDeviceGetUtilizationRates", valid(d) ? d : NULL);
    if (!valid(d)) return NVML_ERROR_INVALID_ARGUMENT;
    if (d->util_gpu < 0 || d->util_memory < 0) return NVML_ERROR_NOT_SUPPORTED;
    utilization->gpu = (unsigned)d->util_gpu;
    utilization->memory = (unsigned)d->util_memory;
    return NVML_SUCCESS;
}

static nvmlReturn_t uint_value(const char *name, nvmlDevice_t d, long long value, unsigned int *out) {
    ENTER(name, valid(d) ? d : NULL);
    if (!valid(d)) return NVML_ERROR_INVALID_ARGUMENT;
    if (value < 0) return NVML_ERROR_NOT_SUPPORTED;
    *out = (unsigned int)value;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t d, int sensor, unsigned int *temp) {
    if (sensor != 0) return NVML_ERROR_NOT_SUPPORTED; /* NVML_TEMPERATURE_GPU only */
    return uint_value("nvmlDeviceGetTemperature", d, valid(d) ? d->temperature : -1, temp);
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t d, unsigned int *power) {
    return uint_value("nvmlDeviceGetPowerUsage", d, valid(d) ? d->power_mw : -1, power);
}

nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t d, unsigned int *limit) {
    return uint_value("nvmlDeviceGetEnforcedPowerLimit", d, valid(d) ? d->power_limit_mw : -1, limit);
}

nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t d, int type, unsigned int *clock) {
    long long value = -1;
    if (valid(d)) value = type == 1 ? d->clock_sm : type == 2 ? d->clock_mem : -1;
    return uint_value("nvmlDeviceGetClockInfo", d, value, clock);
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t d, unsigned int *current, unsigned int *pending) {
    nvmlReturn_t result = uint_value("nvmlDeviceGetMigMode", d, valid(d) ? d->mig : -1, current);
    if (result == NVML_SUCCESS) *pending = *current;
    return result;
}
