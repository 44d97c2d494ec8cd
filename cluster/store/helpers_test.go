package store

import "os"

// osMkdirTemp makes the model test's directory on tmpfs when there is
// one (the model's many syncs cost milliseconds each on a disk).
func osMkdirTemp() (string, error) {
	if dir, err := os.MkdirTemp("/dev/shm", "storemodel"); err == nil {
		return dir, nil
	}
	return os.MkdirTemp("", "storemodel")
}

func osRemoveAll(dir string) error { return os.RemoveAll(dir) }
