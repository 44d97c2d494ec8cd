package img

import (
	"fmt"
	"strings"
	"time"
)

// human renders the image as QEMU's bdrv_image_info_dump does.
func (i *imageInfo) human() string {
	var b strings.Builder
	disk := "unavailable"
	if i.actualSize >= 0 {
		disk = FormatSize(uint64(i.actualSize))
	}
	fmt.Fprintf(&b, "image: %s\nfile format: %s\nvirtual size: %s (%d bytes)\ndisk size: %s\n",
		i.filename, i.format, FormatSize(uint64(i.virtualSize)), i.virtualSize, disk)
	if i.clusterSize != 0 {
		fmt.Fprintf(&b, "cluster_size: %d\n", i.clusterSize)
	}
	if i.dirtyFlag {
		b.WriteString("cleanly shut down: no\n")
	}
	if i.backingFilename != "" {
		fmt.Fprintf(&b, "backing file: %s", i.backingFilename)
		if i.fullBackingFilename != i.backingFilename {
			fmt.Fprintf(&b, " (actual path: %s)", i.fullBackingFilename)
		}
		b.WriteString("\n")
		if i.backingFormat != "" {
			fmt.Fprintf(&b, "backing file format: %s\n", i.backingFormat)
		}
	}
	if len(i.snapshots) > 0 {
		b.WriteString("Snapshot list:\n")
		b.WriteString(snapshotHeader + "\n")
		for _, s := range i.snapshots {
			b.WriteString(s.row() + "\n")
		}
	}
	if i.specific != nil {
		b.WriteString("Format specific information:\n")
		dumpQDict(&b, 1, i.specific)
	}
	return b.String()
}

// snapshotHeader is the header of QEMU's snapshot table
// (bdrv_snapshot_dump with no snapshot).
var snapshotHeader = fmt.Sprintf("%-10s%-17s%8s%20s%13s%11s", "ID", "TAG", "VM SIZE", "DATE", "VM CLOCK", "ICOUNT")

// row renders one snapshot as bdrv_snapshot_dump does; the date is in
// local time.
func (s snapshotInfo) row() string {
	date := time.Unix(s.dateSec, 0).Local().Format("2006-01-02 15:04:05")
	secs := s.vmClockNsec / 1e9
	clock := fmt.Sprintf("%02d:%02d:%02d.%03d", secs/3600, (secs/60)%60, secs%60, (s.vmClockNsec/1e6)%1000)
	icount := ""
	if s.icount != -1 {
		icount = fmt.Sprint(s.icount)
	}
	return fmt.Sprintf("%s %s %8s%20s%13s%11s", padBytes(s.id, 9), padBytes(s.name, 16), FormatSize(s.vmStateSize), date, clock, icount)
}

// padBytes pads s with spaces to n bytes, as C's %-*s does: by bytes, not
// characters, so that a multi-byte name lines up as in QEMU.
func padBytes(s string, n int) string {
	if len(s) >= n {
		return s
	}
	return s + strings.Repeat(" ", n-len(s))
}
