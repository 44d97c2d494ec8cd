package serve

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// readyEnv marks the process Daemonize starts. Its value is the file
// descriptor on which that process reports, by writing one byte, that it
// is listening.
const readyEnv = "OVIS_NBD_READY_FD"

// ExitError is returned by Daemonize when the background server ended
// before it was ready, or printed something before it was. Its messages have already been copied to the
// caller's stderr; the caller should exit with Code and print nothing.
type ExitError struct{ Code int }

func (e *ExitError) Error() string {
	return fmt.Sprintf("the background server exited with status %d before it was ready", e.Code)
}

// IsDaemonChild reports whether this process is the server Daemonize
// started, which must serve in the foreground rather than fork again.
func IsDaemonChild() bool { return os.Getenv(readyEnv) != "" }

// Daemonize is --fork: it starts this program again with the same
// arguments as a background server (in a new session, with standard
// input and output on /dev/null), copies the server's standard error to
// stderr until the server is listening, and returns nil then. The
// server, marked by the OVIS_NBD_READY_FD environment variable, serves in
// the foreground and calls NotifyReady once it listens (after writing any
// pid file), which also sends its later output to /dev/null.
//
// When the server exits before it is ready, Daemonize returns an
// *ExitError with the server's exit status; when it is ready but printed
// something first (a warning), an *ExitError with status 1, as qemu-nbd
// --fork exits.
func Daemonize(stderr io.Writer) error {
	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("Failed to fork: %w", err)
	}
	readyR, readyW, err := os.Pipe()
	if err != nil {
		return fmt.Errorf("Error setting up communication pipe: %w", err)
	}
	defer readyR.Close()
	errR, errW, err := os.Pipe()
	if err != nil {
		readyW.Close()
		return fmt.Errorf("Error setting up communication pipe: %w", err)
	}
	defer errR.Close()
	devNull, err := os.OpenFile(os.DevNull, os.O_RDWR, 0)
	if err != nil {
		readyW.Close()
		errW.Close()
		return fmt.Errorf("Failed to fork: %w", err)
	}
	cmd := exec.Command(exe, os.Args[1:]...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = devNull, devNull, errW
	cmd.ExtraFiles = []*os.File{readyW} // descriptor 3
	cmd.Env = append(os.Environ(), readyEnv+"=3")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	err = cmd.Start()
	readyW.Close()
	errW.Close()
	devNull.Close()
	if err != nil {
		return fmt.Errorf("Failed to fork: %w", err)
	}

	copied := make(chan struct{})
	var printed int64
	go func() {
		printed, _ = io.Copy(stderr, errR)
		close(copied)
	}()
	var b [1]byte
	if n, _ := readyR.Read(b[:]); n == 1 {
		// The server has closed its end of the stderr pipe before it
		// wrote the byte; wait for the copy to drain, but not forever.
		select {
		case <-copied:
		case <-time.After(5 * time.Second):
			cmd.Process.Release()
			return nil
		}
		cmd.Process.Release()
		if printed > 0 {
			// qemu-nbd's parent exits 1 when the server printed
			// anything, a warning included, though it serves on.
			return &ExitError{Code: 1}
		}
		return nil
	}
	<-copied
	err = cmd.Wait()
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		code := exit.ExitCode()
		if code <= 0 {
			code = 1
		}
		return &ExitError{Code: code}
	}
	if err != nil {
		return fmt.Errorf("Cannot read from daemon: %w", err)
	}
	return &ExitError{Code: 1}
}

// NotifyReady tells the process that ran Daemonize that this server is
// listening, and points standard output and error at /dev/null, as
// qemu-nbd does once its parent has gone. It does nothing in a process
// Daemonize did not start.
func NotifyReady() error {
	v := os.Getenv(readyEnv)
	if v == "" {
		return nil
	}
	os.Unsetenv(readyEnv)
	fd, err := strconv.Atoi(v)
	if err != nil || fd < 3 {
		return fmt.Errorf("serve: bad %s=%q", readyEnv, v)
	}
	devNull, err := os.OpenFile(os.DevNull, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer devNull.Close()
	for _, std := range []int{1, 2} {
		if err := unix.Dup2(int(devNull.Fd()), std); err != nil {
			return fmt.Errorf("Could not set stderr to /dev/null: %w", err)
		}
	}
	f := os.NewFile(uintptr(fd), "ready")
	defer f.Close()
	if _, err := f.Write([]byte{1}); err != nil {
		return fmt.Errorf("serve: telling the parent we are ready: %w", err)
	}
	return nil
}

// writePidFile writes the process id to path, as qemu-nbd --pid-file
// does.
func writePidFile(path string) error {
	if err := os.WriteFile(path, []byte(strconv.Itoa(os.Getpid())+"\n"), 0o644); err != nil {
		var pe *os.PathError
		if errors.As(err, &pe) {
			err = pe.Err
		}
		return fmt.Errorf("Could not create '%s': %s", path, strerror(err))
	}
	return nil
}
