package image

import (
	"fmt"
	"io"
	"os"

	"github.com/ovis-storage/ovis/qcow2"
)

// Raw is the name of the raw format, what Probe takes a file that no
// registered format claims for.
const Raw = "raw"

// Probe returns the format of the image name names: the one a file: or
// json: name gives, else the registered format whose Probe claims the
// file's first bytes (formats are tried in name order; at most one should
// claim a file), else Raw. An error is the file's (a *fs.PathError) or
// the name's.
//
// Probing trusts the file: a raw guest disk that wrote another format's
// header into its first sector is taken for that format, and may then
// name any host file as its backing file. Name the format of an image
// from someone else.
func Probe(name string) (string, error) {
	path, format, err := splitName(name, "")
	if err != nil || format != "" {
		return format, err
	}
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	head := make([]byte, ProbeSize)
	n, err := f.ReadAt(head, 0)
	if err != nil && err != io.EOF {
		return "", fmt.Errorf("image: probing %s: %w", path, err)
	}
	head = head[:n]
	for _, name := range Formats() {
		if f, _ := Lookup(name); f.Probe != nil && f.Probe(head) {
			return name, nil
		}
	}
	return Raw, nil
}

// splitName parses the file: and json: names QEMU takes beside paths
// (qcow2.SplitFilename), returning the path and the format they give or
// format as given.
func splitName(name, format string) (path, driver string, err error) {
	if !isPseudoName(name) {
		return name, format, nil
	}
	return qcow2.SplitFilename(name, format)
}

// isPseudoName reports whether name is a file: or json: name.
func isPseudoName(name string) bool {
	return len(name) >= 5 && (name[:5] == "file:" || name[:5] == "json:")
}
