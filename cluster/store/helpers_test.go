package store

import "os"

func osMkdirTemp() (string, error) { return os.MkdirTemp("/dev/shm", "storemodel") }
func osRemoveAll(dir string) error { return os.RemoveAll(dir) }
