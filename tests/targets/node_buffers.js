// Keeps N Buffers of 64 KiB made by one named JS function (their backing
// stores are calloc'd outside V8's heap by node's ArrayBuffer allocator).
//   node --perf-basic-prof --interpreted-frames-native-stack node_buffers.js N
const n = parseInt(process.argv[2] || "50", 10);
const kept = [];
function keepBuffersHere(count) {
  for (let i = 0; i < count; i++) kept.push(Buffer.alloc(64 * 1024, i & 255));
}
keepBuffersHere(n);
console.log("kept " + kept.length + " buffers of " + kept[0].length + " bytes, perf map /tmp/perf-" + process.pid + ".map");
// Gone without its teardown (which frees them): they are in use at its end.
process.kill(process.pid, "SIGKILL");
