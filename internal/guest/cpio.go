package guest

import (
	"bufio"
	"fmt"
	"io"
	"strings"
)

// The "newc" format (SVR4 with no CRC) is the one the kernel unpacks into
// its initial rootfs: Documentation/driver-api/early-userspace/
// buffer-format.rst. Every header field is 8 ASCII hex digits.
const (
	newcMagic   = "070701"
	newcTrailer = "TRAILER!!!"
	newcHdrLen  = 110

	modeDir  = 0o040000
	modeFile = 0o100000
	modeLink = 0o120000
)

// cpioWriter writes a newc archive. Paths are written without a leading
// slash, as the kernel expects, and every parent must be added before its
// children. Not safe for concurrent use.
type cpioWriter struct {
	w   *bufio.Writer
	ino uint32
	err error
}

func newCPIOWriter(w io.Writer) *cpioWriter {
	return &cpioWriter{w: bufio.NewWriter(w), ino: 1}
}

// entry writes one header, the name and the data, each padded to 4 bytes.
func (c *cpioWriter) entry(name string, mode uint32, data []byte) error {
	if c.err != nil {
		return c.err
	}
	name = strings.TrimPrefix(name, "/")
	if name == "" {
		return fmt.Errorf("cpio: empty name")
	}
	nlink := uint32(1)
	if mode&0o170000 == modeDir {
		nlink = 2
	}
	fields := []uint32{
		c.ino, mode, 0, 0, nlink, 0, uint32(len(data)),
		0, 0, 0, 0, uint32(len(name) + 1), 0,
	}
	c.ino++
	var hdr strings.Builder
	hdr.WriteString(newcMagic)
	for _, f := range fields {
		fmt.Fprintf(&hdr, "%08x", f)
	}
	c.write([]byte(hdr.String()))
	c.write([]byte(name))
	c.write([]byte{0})
	c.pad(newcHdrLen + len(name) + 1)
	c.write(data)
	c.pad(len(data))
	if c.err != nil {
		c.err = fmt.Errorf("cpio: writing %s: %w", name, c.err)
	}
	return c.err
}

func (c *cpioWriter) write(p []byte) {
	if c.err == nil {
		_, c.err = c.w.Write(p)
	}
}

func (c *cpioWriter) pad(n int) {
	if r := n % 4; r != 0 {
		c.write(make([]byte, 4-r))
	}
}

// Dir adds a directory.
func (c *cpioWriter) Dir(name string) error { return c.entry(name, modeDir|0o755, nil) }

// File adds a regular file with the permission bits perm.
func (c *cpioWriter) File(name string, perm uint32, data []byte) error {
	return c.entry(name, modeFile|perm&0o7777, data)
}

// Symlink adds a symbolic link name pointing at target.
func (c *cpioWriter) Symlink(name, target string) error {
	return c.entry(name, modeLink|0o777, []byte(target))
}

// Close writes the trailer and flushes. It does not close the underlying
// writer.
func (c *cpioWriter) Close() error {
	if err := c.entry(newcTrailer, 0, nil); err != nil {
		return err
	}
	if err := c.w.Flush(); err != nil {
		return fmt.Errorf("cpio: flush: %w", err)
	}
	return nil
}
