/* Prefix ids of a token sequence's whole cache blocks: the same values as the pure-Python
   loop in batchllm/ordering/prefix_tree.py,
       prefix = hash((prefix, tuple(tokens[start:start + block_size])))
   (CPython's tuple hash reproduced lane by lane, each token hashed by PyObject_Hash), but
   with no block tuple built: ~3.5 ns a token instead of ~10.5 on the development machine.
   Optional: when it cannot be compiled, prefix_tree.py uses the Python loop. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if SIZEOF_VOID_P < 8
#error "prefix ids are 64-bit: a 64-bit build is required"
#endif

#define XXPRIME_1 ((Py_uhash_t)11400714785074694791ULL)
#define XXPRIME_2 ((Py_uhash_t)14029467366897019727ULL)
#define XXPRIME_5 ((Py_uhash_t)2870177450012600261ULL)
#define XXROTATE(x) (((x) << 31) | ((x) >> 33))

static inline Py_uhash_t lane_in(Py_uhash_t acc, Py_uhash_t lane) {
    acc += lane * XXPRIME_2;
    acc = XXROTATE(acc);
    return acc * XXPRIME_1;
}

static inline Py_hash_t tuple_end(Py_uhash_t acc, Py_ssize_t length) {
    acc += (Py_uhash_t)length ^ (XXPRIME_5 ^ 3527539UL);
    return acc == (Py_uhash_t)-1 ? 1546275796 : (Py_hash_t)acc;
}

static PyObject *block_prefix_ids(PyObject *module, PyObject *args) {
    PyObject *tokens;
    Py_ssize_t block_size;
    if (!PyArg_ParseTuple(args, "On:block_prefix_ids", &tokens, &block_size))
        return NULL;
    if (block_size < 1)
        return PyErr_Format(PyExc_ValueError, "block_size must be >= 1, got %zd", block_size);
    PyObject *sequence = PySequence_Fast(tokens, "tokens must be a sequence of ints");
    if (sequence == NULL)
        return NULL;
    Py_ssize_t length = PySequence_Fast_GET_SIZE(sequence);
    PyObject **items = PySequence_Fast_ITEMS(sequence);
    Py_ssize_t blocks = length / block_size;
    PyObject *out = PyBytes_FromStringAndSize(NULL, blocks * (Py_ssize_t)sizeof(Py_hash_t));
    if (out == NULL) {
        Py_DECREF(sequence);
        return NULL;
    }
    Py_hash_t *ids = (Py_hash_t *)PyBytes_AS_STRING(out);
    Py_hash_t prefix = 0;
    for (Py_ssize_t block = 0; block < blocks; block++) {
        Py_uhash_t acc = XXPRIME_5;
        for (Py_ssize_t i = block * block_size, end = i + block_size; i < end; i++) {
            Py_hash_t lane = PyObject_Hash(items[i]);
            if (lane == -1)
                goto error;
            acc = lane_in(acc, (Py_uhash_t)lane);
        }
        Py_hash_t block_hash = tuple_end(acc, block_size);
        PyObject *previous = PyLong_FromSsize_t(prefix);  /* hash(int) is not the identity for every int */
        if (previous == NULL)
            goto error;
        Py_hash_t previous_hash = PyObject_Hash(previous);
        Py_DECREF(previous);
        acc = lane_in(lane_in(XXPRIME_5, (Py_uhash_t)previous_hash), (Py_uhash_t)block_hash);
        prefix = tuple_end(acc, 2);
        ids[block] = prefix;
    }
    Py_DECREF(sequence);
    return out;
error:
    Py_DECREF(sequence);
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"block_prefix_ids", block_prefix_ids, METH_VARARGS,
     "block_prefix_ids(tokens, block_size) -> bytes: 8 bytes (native int64) per whole block, "
     "the chained prefix id hash((previous id, tuple(block)))."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_block_ids", NULL, 0, methods};

PyMODINIT_FUNC PyInit__block_ids(void) { return PyModule_Create(&module); }
