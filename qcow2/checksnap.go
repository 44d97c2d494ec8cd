package qcow2

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
	"syscall"
)

// ErrorReport starts a CheckResult message that qemu-img prints through
// error_report, behind its program name ("qemu-img: "). Callers replace
// it with their own name.
const ErrorReport = "\x00"

// snapshotExtraQemu is sizeof(QCowSnapshotExtraData) in QEMU 7.2: the VM
// state size, the disk size and the icount. QEMU writes at least this much.
const snapshotExtraQemu = extraICount + 8

// errnoError is an errno as qemu-img prints it.
type errnoError struct {
	msg   string
	errno syscall.Errno
}

func (e errnoError) Error() string        { return e.msg }
func (e errnoError) Is(target error) bool { return target == e.errno }

var (
	errTooBig  error = errnoError{"File too large", syscall.EFBIG}
	errInvalid error = errnoError{"Invalid argument", syscall.EINVAL}
)

// checkReadSnapshotsLocked reads the snapshot table for Check of an image
// opened ForCheck (QEMU's qcow2_check_read_snapshot_table). With
// RepairAll it drops snapshots past QEMU's limits (rewriting the count in
// the header) and extra data past 1024 bytes. Counters go to sres;
// messages to res. It sets img.snapshots and img.checkSnapSize, and
// returns an errnoError when the table cannot be read.
func (img *Image) checkReadSnapshotsLocked(res, sres *CheckResult, fix RepairMode) error {
	repair := fix == RepairAll
	nb, off := uint64(img.hdr.NbSnapshots), img.hdr.SnapshotsOffset
	img.snapshots, img.checkSnapSize = nil, 0
	reduced := 0
	if nb > maxSnapshots && repair {
		res.msg("Discarding %d overhanging snapshots", nb-maxSnapshots)
		reduced += int(nb - maxSnapshots)
		nb = maxSnapshots
	}
	// qcow2_validate_table.
	var err error
	switch {
	case nb > maxSnapshots:
		res.msg(ErrorReport + "ERROR snapshot table too large")
		err = errTooBig
	case math.MaxInt64-nb*snapshotFixedLen < off || off%uint64(img.clusterSize) != 0:
		res.msg(ErrorReport + "ERROR snapshot table offset invalid")
		err = errInvalid
	}
	if err != nil {
		sres.CheckErrors++
		if nb > maxSnapshots {
			res.msg("You can force-remove all %d overhanging snapshots with qemu-img check -r all", nb-maxSnapshots)
		}
		return err
	}
	snaps, size, r, dropped, err := img.readSnapshotsForCheck(res, off, int(nb), repair)
	if err != nil {
		sres.CheckErrors++
		res.msg(ErrorReport+"ERROR failed to read the snapshot table: %s", err)
		if h, ok := err.(snapshotHintError); ok && h.hint != "" {
			res.msg("%s", h.hint)
		}
		return h2errno(err)
	}
	reduced += r
	img.snapshots, img.checkSnapSize = snaps, size
	sres.Corruptions += reduced + dropped
	if reduced != 0 {
		img.hdr.NbSnapshots = uint32(len(snaps))
		var b [4]byte
		binary.BigEndian.PutUint32(b[:], img.hdr.NbSnapshots)
		_, err := img.file.WriteAt(b[:], 60)
		if err == nil {
			err = img.file.Sync()
		}
		if err != nil {
			sres.CheckErrors++
			res.msg("ERROR failed to update the snapshot count in the image header: %v", err)
			return fmt.Errorf("qcow2: writing the snapshot count: %w", err)
		}
		sres.CorruptionsFixed += reduced
		sres.Corruptions -= reduced
	}
	if img.v3 {
		for i := range snaps {
			if len(snaps[i].Extra) < snapshotExtraV3 {
				sres.Corruptions++
				res.msg("%s snapshot table entry %d is incomplete", repairing(repair), i)
			}
		}
	}
	return nil
}

// snapshotHintError is a snapshot table error with QEMU's hint line.
type snapshotHintError struct {
	msg, hint string
	err       error
}

func (e snapshotHintError) Error() string { return e.msg }
func (e snapshotHintError) Unwrap() error { return e.err }

func h2errno(err error) error {
	if h, ok := err.(snapshotHintError); ok {
		return h.err
	}
	return err
}

// readSnapshotsForCheck reads nb entries at off as QEMU's
// qcow2_do_read_snapshots does, bytes past the end of the file reading as
// zeros. It returns the entries, the table's size, how many snapshots it
// dropped and how many entries lost extra data (both only with repair).
func (img *Image) readSnapshotsForCheck(res *CheckResult, off uint64, nb int, repair bool) (snaps []Snapshot, size int64, reduced, dropped int, err error) {
	pos := off
	var tableLen uint64
	for i := 0; i < nb; i++ {
		pre := pos
		tableLen = (tableLen + 7) &^ 7
		pos = (pos + 7) &^ 7
		fixed, err := img.readZeroFilled(pos, snapshotFixedLen)
		if err != nil {
			return nil, 0, 0, 0, fmt.Errorf("Failed to read snapshot table: %w", err)
		}
		pos += snapshotFixedLen
		s, id16, name16, extra32 := decodeSnapshotFixed(fixed)
		idLen, nameLen, extraLen := uint64(id16), uint64(name16), uint64(extra32)
		end := pos + extraLen
		if extraLen > maxSnapshotExtra {
			if !repair {
				return nil, 0, 0, 0, snapshotHintError{
					msg:  fmt.Sprintf("Too much extra metadata in snapshot table entry %d", i),
					hint: "You can force-remove this extra metadata with qemu-img check -r all",
					err:  errTooBig,
				}
			}
			res.msg("Discarding too much extra metadata in snapshot table entry %d (%d > %d)", i, extraLen, maxSnapshotExtra)
			dropped++
			extraLen = maxSnapshotExtra
		}
		if s.Extra, err = img.readZeroFilled(pos, int64(extraLen)); err != nil {
			return nil, 0, 0, 0, fmt.Errorf("Failed to read snapshot table: %w", err)
		}
		pos = end
		s.decodeExtra()
		if !s.HasDiskSize {
			s.DiskSize = uint64(img.size)
		}
		strs, err := img.readZeroFilled(pos, int64(idLen+nameLen))
		if err != nil {
			return nil, 0, 0, 0, fmt.Errorf("Failed to read snapshot table: %w", err)
		}
		pos += idLen + nameLen
		// QEMU keeps them as C strings.
		s.ID, s.Name = cString(strs[:idLen]), cString(strs[idLen:])
		tableLen += snapshotFixedLen + extraLen + idLen + nameLen
		if tableLen > maxSnapshotTableBytes || pos-off > math.MaxInt32 {
			if !repair {
				return nil, 0, 0, 0, snapshotHintError{
					msg:  "Snapshot table is too big",
					hint: fmt.Sprintf("You can force-remove all %d overhanging snapshots with qemu-img check -r all", nb-i),
					err:  errTooBig,
				}
			}
			res.msg("Discarding %d overhanging snapshots (snapshot table is too big)", nb-i)
			reduced += nb - i
			pos = pre
			break
		}
		snaps = append(snaps, s)
	}
	return snaps, int64(pos - off), reduced, dropped, nil
}

// checkFixSnapshotsLocked rewrites the snapshot table when reading it
// found something to repair (QEMU's qcow2_check_fix_snapshot_table): a
// new table in free clusters, the header pointed at it, the old one freed
// and zeroed (QEMU discards it). Runs inside Check, after the refcounts
// were repaired and the caches started afresh.
func (img *Image) checkFixSnapshotsLocked(res, sres *CheckResult, fix RepairMode) error {
	if sres.Corruptions == 0 || fix != RepairAll {
		return nil
	}
	if err := img.writeCheckedSnapshotsLocked(res); err != nil {
		sres.CheckErrors++
		res.msg("ERROR failed to update snapshot table: %s", err)
		return err
	}
	sres.CorruptionsFixed += sres.Corruptions
	sres.Corruptions = 0
	return nil
}

// writeCheckedSnapshotsLocked is QEMU's qcow2_write_snapshots for Check:
// every entry gets at least QEMU's 24 bytes of extra data, and the table
// is not padded past its last entry.
func (img *Image) writeCheckedSnapshotsLocked(res *CheckResult) error {
	snaps := append([]Snapshot(nil), img.snapshots...)
	var n int64
	for i := range snaps {
		s := &snaps[i]
		if len(s.Extra) < snapshotExtraQemu {
			s.Extra = append(append([]byte(nil), s.Extra...), make([]byte, snapshotExtraQemu-len(s.Extra))...)
		}
		if err := s.checkEncodable(); err != nil {
			return err
		}
		n = (n+7)&^7 + snapshotFixedLen + int64(len(s.encodeExtra(img.hdr.Version))+len(s.ID)+len(s.Name))
	}
	var off uint64
	if len(snaps) > 0 {
		var err error
		if off, err = img.allocExclusiveLocked(img.clustersFor(n)); err != nil {
			return err
		}
		tbl := encodeSnapshotTable(snaps, img.hdr.Version)[:n]
		if _, err := img.file.WriteAt(tbl, int64(off)); err != nil {
			return fmt.Errorf("qcow2: writing snapshot table at %#x: %w", off, err)
		}
	}
	if err := img.flushExclusiveLocked(); err != nil {
		return err
	}
	oldOff, oldLen := img.hdr.SnapshotsOffset, img.checkSnapSize
	img.hdr.NbSnapshots = uint32(len(snaps))
	img.hdr.SnapshotsOffset = off
	if err := img.writeHeaderLocked(); err != nil {
		return err
	}
	if err := img.file.Sync(); err != nil {
		return fmt.Errorf("qcow2: syncing the header: %w", err)
	}
	img.snapshots, img.checkSnapSize = snaps, n
	if oldLen <= 0 {
		return nil
	}
	// QEMU's qcow2_free_clusters: all or nothing, and a failure is only
	// reported.
	cs := uint64(img.clusterSize)
	first, last := oldOff/cs, (oldOff+uint64(oldLen)-1)/cs
	for c := first; c <= last; c++ {
		rc, err := img.refcountExclusiveLocked(int64(c))
		if err != nil {
			return err
		}
		if rc == 0 {
			res.msg("qcow2_free_clusters failed: Invalid argument")
			return nil
		}
	}
	for c := first; c <= last; c++ {
		rc, err := img.refcountExclusiveLocked(int64(c))
		if err != nil {
			return err
		}
		if err := img.refAddLocked(int64(c), -1); err != nil {
			return err
		}
		if rc == 1 {
			if err := img.zeroClusterLocked(int64(c)); err != nil {
				return err
			}
		}
	}
	return img.flushExclusiveLocked()
}

// cString is b up to its first NUL.
func cString(b []byte) string {
	if i := bytes.IndexByte(b, 0); i >= 0 {
		b = b[:i]
	}
	return string(b)
}
