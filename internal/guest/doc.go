// Package guest boots a real Linux guest under QEMU for tests: Debian's
// cloud kernel, busybox and the host's e2fsprogs in an initramfs built
// here, with one virtio disk that the test names (an NBD export of ovis).
// A shell script runs inside the guest on its own and stops at phase
// boundaries for the test to look around (read the nodes' metrics, kill a
// node) before it answers.
//
// Files, by concern:
//
//   - cpio.go: the "newc" archive writer the kernel unpacks
//   - initramfs.go: the kernel, its modules in modules.dep order, the
//     tools and their shared libraries (ldd), the archive
//   - init.go: the guest's /init and the functions its script gets
//   - vm.go: Config, QEMU's lifecycle, the control port, events
//
// The control port is the guest's second serial port (ttyS1), a unix
// socket the test listens on and QEMU connects to. The guest writes lines
// "OVIS KIND [NAME] [KEY=VALUE...]"; at a PHASE it waits for the line
// "go". The kinds /init sends are BOOTED, PHASE, DONE and FAIL; a script
// may say others. The console (ttyS0: the kernel log and the script's
// output) is QEMU's standard output and is kept whole for the test.
//
// Invariants:
//
//  1. QEMU never outlives Config.Timeout, the caller's context or Close:
//     it is killed, and Close waits for it and for every goroutine.
//  2. The guest never waits for an answer longer than
//     Config.AnswerTimeout: it then fails and powers off (-no-reboot
//     makes a reboot or a panic end QEMU too).
//  3. A failing command of the script (set -e), a FAIL, QEMU's exit
//     before DONE and a phase out of order are errors of Phase or Wait,
//     never a hang.
//
// Order for callers: FindKernel; Start; for each phase of the script,
// Phase then Continue; Wait; Close (always, in a t.Cleanup). Console and
// Events may be read at any time.
//
// KVM is used when /dev/kvm opens and a kernel boots under it (some
// nested hosts open /dev/kvm but hang the kernel); TCG otherwise, or when
// OVIS_GUEST_TCG is set, which gives the worst case of a CI machine.
//
// Not done here: networking, more than one disk, a guest of another
// architecture, compressed kernel modules (Debian's cloud kernel has
// none).
package guest
