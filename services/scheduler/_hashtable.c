/* Block hash -> object table for the prefix tree's index (block_index.py).
 *
 * What a dict of int -> node does for BlockIndex's generations, without a Python int per
 * key and without a reference per key. Laid out as CPython's compact dict is:
 *
 * - ``index``: open addressing (linear probing, power-of-two size, at most two thirds
 *   full), each slot an entry's number + 1 (0: empty): 4 bytes a slot, so the part a put
 *   writes at random stays small;
 * - entries in put order: each key (an int64, read straight from a packed run's buffer,
 *   array('q'), or converted once from an int of a tuple or list) and its run's number;
 * - runs: one per ``put``, holding the value (one reference for the whole run).
 *
 * A key put again points at the newer run; the older run keeps its reference until the
 * table goes, as a dead node stays in BlockIndex until its generation is retired. A key
 * outside int64 (not a prefixmesh hash) goes to a plain dict beside the table, so any
 * int behaves as in a dict. Nothing is ever deleted: BlockIndex retires whole tables, and
 * retiring one drops a reference per run, in put order.
 *
 * Not tracked by the garbage collector: the values (the tree's nodes) never refer back
 * to the table, so no cycle runs through it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    PyObject_HEAD
    uint32_t *index;     /* slot -> entry number + 1; 0: an empty slot */
    Py_ssize_t mask;     /* slots - 1 */
    int64_t *keys;       /* entry -> key, in put order */
    uint32_t *owner;     /* entry -> run number */
    Py_ssize_t used;     /* entries */
    Py_ssize_t room;     /* entries allocated */
    PyObject **runs;     /* run number -> value (a reference each) */
    Py_ssize_t nruns;
    Py_ssize_t runs_room;
    PyObject *big;       /* dict of the keys outside int64, or NULL */
} HashTable;

#define MIN_ENTRIES 16
/* Entry and run numbers are uint32s (the index stores entry + 1); on a 32-bit build the
 * memory runs out long before. */
#if SIZEOF_SIZE_T > 4
#define MAX_ENTRIES ((Py_ssize_t)UINT32_MAX - 1)
#else
#define MAX_ENTRIES (PY_SSIZE_T_MAX / 32)
#endif

/* The keys are hashes already, but not always of every bit: mix before masking. */
static inline Py_ssize_t
slot_of(int64_t key, Py_ssize_t mask)
{
    uint64_t k = (uint64_t)key;
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return (Py_ssize_t)(k & (uint64_t)mask);
}

/* Slots for ``entries`` at most two thirds full. */
static Py_ssize_t
slots_for(Py_ssize_t entries)
{
    Py_ssize_t slots = 2 * MIN_ENTRIES;
    while (slots * 2 < entries * 3 + 3)
        slots *= 2;
    return slots;
}

/* A new index of ``slots`` slots over the entries held. */
static int
reindex(HashTable *t, Py_ssize_t slots)
{
    uint32_t *index = PyMem_Calloc(slots, sizeof(uint32_t));
    if (index == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t mask = slots - 1;
    for (Py_ssize_t e = 0; e < t->used; e++) {
        Py_ssize_t s = slot_of(t->keys[e], mask);
        while (index[s] != 0)
            s = (s + 1) & mask;
        index[s] = (uint32_t)(e + 1);
    }
    PyMem_Free(t->index);
    t->index = index;
    t->mask = mask;
    return 0;
}

/* Room for one more entry (and its slot). */
static int
reserve_entry(HashTable *t)
{
    if (t->used >= MAX_ENTRIES) {
        PyErr_SetString(PyExc_OverflowError, "HashTable: too many entries");
        return -1;
    }
    if (t->used == t->room) {
        Py_ssize_t room = t->room * 2;
        int64_t *keys = PyMem_Realloc(t->keys, room * sizeof(int64_t));
        if (keys == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        t->keys = keys;
        uint32_t *owner = PyMem_Realloc(t->owner, room * sizeof(uint32_t));
        if (owner == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        t->owner = owner;
        t->room = room;
    }
    if ((t->used + 1) * 3 > (t->mask + 1) * 2)
        return reindex(t, (t->mask + 1) * 2);
    return 0;
}

/* Point ``key`` at run ``run``. */
static int
set_key(HashTable *t, int64_t key, uint32_t run)
{
    uint32_t *index = t->index;
    Py_ssize_t mask = t->mask;
    Py_ssize_t s = slot_of(key, mask);
    uint32_t e;
    while ((e = index[s]) != 0) {
        if (t->keys[e - 1] == key) {
            t->owner[e - 1] = run;
            return 0;
        }
        s = (s + 1) & mask;
    }
    if ((t->used + 1) * 3 > (mask + 1) * 2 || t->used == t->room) {
        if (reserve_entry(t) < 0)
            return -1;
        return set_key(t, key, run);  /* the index may have been rebuilt */
    }
    t->keys[t->used] = key;
    t->owner[t->used] = run;
    index[s] = (uint32_t)(++t->used);
    return 0;
}

static PyObject *
get_key(HashTable *t, int64_t key)
{
    Py_ssize_t s = slot_of(key, t->mask);
    uint32_t e;
    while ((e = t->index[s]) != 0) {
        if (t->keys[e - 1] == key)
            return t->runs[t->owner[e - 1]];
        s = (s + 1) & t->mask;
    }
    return NULL;
}

/* A new run holding ``value``; its number in ``*run``. */
static int
add_run(HashTable *t, PyObject *value, uint32_t *run)
{
    if (t->nruns >= MAX_ENTRIES) {
        PyErr_SetString(PyExc_OverflowError, "HashTable: too many puts");
        return -1;
    }
    if (t->nruns == t->runs_room) {
        Py_ssize_t room = t->runs_room * 2;
        PyObject **runs = PyMem_Realloc(t->runs, room * sizeof(PyObject *));
        if (runs == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        t->runs = runs;
        t->runs_room = room;
    }
    Py_INCREF(value);
    t->runs[t->nruns] = value;
    *run = (uint32_t)t->nruns++;
    return 0;
}

/* An int key as an int64; 1 when it does not fit (then it belongs in ``big``), -1 on an
 * error (not an int). */
static int
as_key(PyObject *obj, int64_t *key)
{
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow)
        return 1;
    *key = (int64_t)v;
    return 0;
}

static PyObject *
HashTable_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"entries", NULL};
    Py_ssize_t entries = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|n:HashTable", kwlist, &entries))
        return NULL;
    if (entries < 0 || entries > MAX_ENTRIES) {
        PyErr_SetString(PyExc_ValueError, "HashTable: entries out of range");
        return NULL;
    }
    if (entries < MIN_ENTRIES)
        entries = MIN_ENTRIES;
    HashTable *t = (HashTable *)type->tp_alloc(type, 0);
    if (t == NULL)
        return NULL;
    t->keys = PyMem_Malloc(entries * sizeof(int64_t));
    t->owner = PyMem_Malloc(entries * sizeof(uint32_t));
    t->runs = PyMem_Malloc(MIN_ENTRIES * sizeof(PyObject *));
    if (t->keys == NULL || t->owner == NULL || t->runs == NULL) {
        Py_DECREF(t);
        return PyErr_NoMemory();
    }
    t->room = entries;
    t->runs_room = MIN_ENTRIES;
    if (reindex(t, slots_for(entries)) < 0) {
        Py_DECREF(t);
        return NULL;
    }
    return (PyObject *)t;
}

static void
HashTable_dealloc(HashTable *t)
{
    for (Py_ssize_t r = 0; r < t->nruns; r++)
        Py_DECREF(t->runs[r]);
    PyMem_Free(t->index);
    PyMem_Free(t->keys);
    PyMem_Free(t->owner);
    PyMem_Free(t->runs);
    Py_XDECREF(t->big);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

PyDoc_STRVAR(put_doc,
"put(hashes, value)\n--\n\n"
"Point every hash of ``hashes`` (an int64 buffer such as array('q'), or a sequence of\n"
"ints) at ``value``.");

static PyObject *
HashTable_put(HashTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "put(hashes, value) takes two arguments");
        return NULL;
    }
    PyObject *hashes = args[0], *value = args[1];
    uint32_t run;
    if (PyObject_CheckBuffer(hashes)) {
        Py_buffer view;
        if (PyObject_GetBuffer(hashes, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
            return NULL;
        const char *f = view.format;
        if (f != NULL && (*f == '<' || *f == '@' || *f == '='))
            f++;
        if (view.itemsize != 8 || f == NULL || (strcmp(f, "q") != 0 && strcmp(f, "l") != 0)) {
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_TypeError, "put: a buffer of hashes must hold int64s");
            return NULL;
        }
        const int64_t *keys = (const int64_t *)view.buf;
        Py_ssize_t n = view.len / 8;
        if (n > 0 && add_run(t, value, &run) < 0) {
            PyBuffer_Release(&view);
            return NULL;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            if (set_key(t, keys[i], run) < 0) {
                PyBuffer_Release(&view);
                return NULL;
            }
        }
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    PyObject *seq = PySequence_Fast(hashes, "put: hashes must be a buffer or a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int have_run = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t key;
        int r = as_key(items[i], &key);
        if (r == 0) {
            if (!have_run && add_run(t, value, &run) < 0)
                goto error;
            have_run = 1;
            if (set_key(t, key, run) < 0)
                goto error;
        }
        else if (r == 1) {
            if (t->big == NULL && (t->big = PyDict_New()) == NULL)
                goto error;
            if (PyDict_SetItem(t->big, items[i], value) < 0)
                goto error;
        }
        else
            goto error;
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
error:
    Py_DECREF(seq);
    return NULL;
}

PyDoc_STRVAR(get_doc,
"get(hash)\n--\n\nThe value ``hash`` points at, or None.");

static PyObject *
HashTable_get(HashTable *t, PyObject *obj)
{
    int64_t key;
    int r = as_key(obj, &key);
    if (r < 0)
        return NULL;
    PyObject *found;
    if (r == 0)
        found = get_key(t, key);
    else
        found = t->big != NULL ? PyDict_GetItemWithError(t->big, obj) : NULL;
    if (found == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    Py_INCREF(found);
    return found;
}

/* values(): an iterator over the runs in put order, then over ``big``'s values. */
typedef struct {
    PyObject_HEAD
    HashTable *table;
    Py_ssize_t run;      /* next run */
    Py_ssize_t big_pos;  /* PyDict_Next position in ``big`` once the runs are done */
} ValuesIter;

static void
ValuesIter_dealloc(ValuesIter *it)
{
    Py_XDECREF(it->table);
    PyObject_Free(it);
}

static PyObject *
ValuesIter_next(ValuesIter *it)
{
    HashTable *t = it->table;
    if (it->run < t->nruns) {
        PyObject *v = t->runs[it->run++];
        Py_INCREF(v);
        return v;
    }
    PyObject *k, *v;
    if (t->big != NULL && PyDict_Next(t->big, &it->big_pos, &k, &v)) {
        Py_INCREF(v);
        return v;
    }
    return NULL;
}

static PyTypeObject ValuesIterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "prefixmesh.services.scheduler._hashtable.ValuesIter",
    .tp_basicsize = sizeof(ValuesIter),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)ValuesIter_dealloc,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)ValuesIter_next,
};

PyDoc_STRVAR(values_doc,
"values()\n--\n\n"
"An iterator over the values put, each once per put (also where every hash of that put\n"
"was put again since), in put order.");

static PyObject *
HashTable_values(HashTable *t, PyObject *Py_UNUSED(ignored))
{
    ValuesIter *it = PyObject_New(ValuesIter, &ValuesIterType);
    if (it == NULL)
        return NULL;
    Py_INCREF(t);
    it->table = t;
    it->run = 0;
    it->big_pos = 0;
    return (PyObject *)it;
}

static Py_ssize_t
HashTable_len(HashTable *t)
{
    return t->used + (t->big != NULL ? PyDict_GET_SIZE(t->big) : 0);
}

static PyMethodDef HashTable_methods[] = {
    {"put", (PyCFunction)(void (*)(void))HashTable_put, METH_FASTCALL, put_doc},
    {"get", (PyCFunction)HashTable_get, METH_O, get_doc},
    {"values", (PyCFunction)HashTable_values, METH_NOARGS, values_doc},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods HashTable_as_sequence = {
    .sq_length = (lenfunc)HashTable_len,
};

static PyTypeObject HashTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "prefixmesh.services.scheduler._hashtable.HashTable",
    .tp_doc = PyDoc_STR("HashTable(entries=0)\n--\n\n"
                        "Block hash -> object, int64 keys, made with room for ``entries`` "
                        "(it grows past them)."),
    .tp_basicsize = sizeof(HashTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = HashTable_new,
    .tp_dealloc = (destructor)HashTable_dealloc,
    .tp_methods = HashTable_methods,
    .tp_as_sequence = &HashTable_as_sequence,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_hashtable",
    .m_doc = PyDoc_STR("The block index's table of int64 hashes (services/scheduler/block_index.py)."),
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__hashtable(void)
{
    if (PyType_Ready(&HashTableType) < 0 || PyType_Ready(&ValuesIterType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&HashTableType);
    if (PyModule_AddObject(m, "HashTable", (PyObject *)&HashTableType) < 0) {
        Py_DECREF(&HashTableType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
