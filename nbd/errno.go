package nbd

import (
	"errors"
	"syscall"

	"github.com/ovis-storage/ovis/block"
)

// This file holds the mapping of device errors to the NBD error a client
// sees.

// errnoOf maps a device error to the NBD error a client sees: an Errno
// in the chain as is; block.ErrReadOnly, EPERM, EACCES and EROFS as
// EPERM; block.ErrOutOfRange as ENOSPC for writes and EINVAL otherwise;
// ENOSPC, EDQUOT and EFBIG as ENOSPC (the spec asks for that mapping);
// ENOMEM as ENOMEM; block.ErrClosed as ESHUTDOWN; anything else as EIO.
func errnoOf(err error, typ cmdType) Errno {
	var e Errno
	switch {
	case errors.As(err, &e) && e != 0:
		return e
	case errors.Is(err, block.ErrReadOnly), errors.Is(err, syscall.EPERM), errors.Is(err, syscall.EACCES), errors.Is(err, syscall.EROFS):
		return EPERM
	case errors.Is(err, block.ErrOutOfRange):
		if typ == cmdWrite || typ == cmdWriteZeroes {
			return ENOSPC
		}
		return EINVAL
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT), errors.Is(err, syscall.EFBIG):
		return ENOSPC
	case errors.Is(err, syscall.ENOMEM):
		return ENOMEM
	case errors.Is(err, block.ErrClosed):
		return ESHUTDOWN
	}
	return EIO
}

func isNotSupported(err error) bool {
	return err != nil && (errors.Is(err, syscall.EOPNOTSUPP) || errors.Is(err, errors.ErrUnsupported))
}
