// src/python/pymem: CPython's own allocator, the `python` domain (issue 32).
//
// pymalloc serves every object of 512 bytes or less from its own arenas: a
// malloc probe never sees them. The interpreter calls it through its
// allocator structs (3.11: static PyMemAllocatorEx _PyMem and _PyObject in
// Objects/obmalloc.c, {ctx, malloc, calloc, realloc, free}; 3.12 moves them
// into _PyRuntime.allocators), so the functions to probe are the ones those
// structs point to in the process: _PyObject_Malloc, _PyObject_Calloc,
// _PyObject_Realloc, _PyObject_Free (static: not in .dynsym). Where the
// structs are: the exported wrappers (PyObject_Malloc and friends, in
// .dynsym) load them RIP-relative; their code is read here, not a header.
//
// Debian's python3.11 is built with LTO and PGO: the wrappers are inlined
// into their callers, and PGO promoted each indirect call to a compare with
// the likely target and an inlined copy of it (`cmp $_PyObject_Malloc,%rax;
// jne <indirect call>; <pymalloc inline>`: 190 sites for malloc). A probe
// on _PyObject_Malloc saw 2,003 of 100,000 object() allocations. Making
// those compares fail sends every call through the struct: its malloc slot
// (and _PyMem's) is pointed at a `jmp _PyObject_Malloc` instruction of the
// interpreter's own code (a tail call, found by decoding; the same function
// reached), where the probe goes: an emulated jmp, entry and return probe on
// one trap (the function itself starts with `lea; sub rsp`: single-stepped).
// The slots get their old values back when tracing ends (if they still hold
// ours). A function with no such jmp keeps its slot, its probe on itself,
// and its inlined sites unseen (`inlined_sites`: counted, in the notes).
//
// PYTHONMALLOC=malloc: the structs point to the raw allocator (malloc
// itself), nothing is probed here and everything stays malloc's.
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "probes/probe_placement.h"
#include "procfs/proc_maps.h"
#include "python/python.h"

namespace memtrace::python {

struct PyMemSite {
  uint32_t role = 0;         // MT_ROLE_PY_*
  std::string name;          // "_PyObject_Malloc", "jmp _PyObject_Malloc at 0x4e6b4d"
  uint64_t vaddr = 0;        // in the file
  uint64_t file_offset = 0;  // for the uprobe
  probes::Placement placement;
};

// A slot of an allocator struct the process's memory gets (runtime addresses).
struct PyMemSlot {
  uint64_t addr = 0, was = 0, now = 0;
};

struct PyMem {
  std::string path;  // the interpreter's file (probes go there)
  std::vector<PyMemSite> sites;
  std::vector<PyMemSlot> slots;  // to write now, and to restore at the end
  uint32_t inlined_sites = 0;    // promoted inline copies of a function whose slot could not be moved: unseen
  std::string note;              // one line: what was found
};

// pymalloc in a process whose interpreter detect() found (maps: its
// mappings; root: as detect's). nullopt with *why set: no python domain
// (PYTHONMALLOC=malloc, allocator hooks installed, a layout not understood).
std::optional<PyMem> find_pymalloc(pid_t pid, const Interpreter& in, const std::vector<procfs::Mapping>& maps,
                                   std::string* why, const std::string& root = "");

// Writes each slot's `now` (or with restore, its `was` where it still holds
// `now`) into the process; false with *err on the first failure.
bool write_slots(pid_t pid, const std::vector<PyMemSlot>& slots, bool restore, std::string* err);

}  // namespace memtrace::python
