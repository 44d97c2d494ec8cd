// Package histcheck checks histories of block reads and writes, recorded
// by clients of a block device through any number of gateways, against a
// register model: every block is a register that holds exactly one
// written value at a time, and the device is linearizable per block.
// It is the checker of issue 26's history tests (cmd/ovis/history_test.go,
// bench/history.sh); it does no I/O and reads no clock: the driver passes
// the times in.
//
// Files, by concern:
//
//   - history.go: operations (Op), their outcomes, the Recorder
//   - value.go: the self-checking 4 KiB values clients write (Encode) and
//     what a read's bytes are (Decode): zeros, one value, torn, foreign
//   - check.go: Check, the per-register linearizability check, and the
//     Report with its Violations
//
// The model. Each written value is unique in the whole history (the
// driver numbers them) and written to one register once. A register
// starts as zeros (value 0, written "before the beginning"). An operation
// is an interval [Start, End] of the driver's monotonic clock, closed as
// in porcupine: two operations are ordered only when one's End is
// strictly before the other's Start.
//
//   - A write is acknowledged (OK) when the device acknowledged it with
//     FUA, or acknowledged it and a FLUSH sent after it on the same
//     connection succeeded; its End is then the FUA reply's or the
//     flush's. A write that failed, timed out, or whose flush did not
//     succeed is indeterminate: it may take effect at any later time, or
//     never (its End is +∞).
//   - A read that succeeded returns bytes; one that failed (EIO, a broken
//     connection, a timeout) gives no information and is only counted.
//
// What Check verifies, per register:
//
//  1. A read returns exactly one value or zeros: never a mix of the
//     sectors of several values (ViolationTorn).
//  2. A read returns a value written to this register, whose write had
//     started before the read ended; never bytes no write produced, nor a
//     value written to another block (ViolationNeverWritten).
//  3. A read never returns a value older than one that was acknowledged
//     before the read started (ViolationLostWrite), nor older than one
//     that another read had returned before it started, through the same
//     gateway (ViolationStaleRead) or another one (ViolationInvertedRead).
//     "v is older than u" is known when an operation of v (its write or a
//     read of it) ended before an operation of u started: u's write then
//     took effect after v's.
//
// Rules 2 and 3 together are exactly linearizability of a register with
// unique values (Gibbons and Korach, 1997: no two forward zones overlap
// and no backward zone lies inside a forward one). Check takes each
// register's operations in order of their start and judges each read
// against what is known at its start; a read that broke a rule is not
// taken in as evidence, so that one lost write is reported at the reads
// that missed it, not at the good reads after them. Every report is a
// real violation, and a history that is not linearizable gets at least
// one (checkRegister has the argument; the property test compares Check
// with porcupine on random histories). Time: O(n·V) per register of n
// operations and V values.
//
// Not done here: multi-block atomicity (a write of several blocks), reads
// of partial blocks, and any statement about durability across a crash
// beyond what the history shows (a lost write is found only if some read
// after its acknowledgement misses it).
package histcheck
