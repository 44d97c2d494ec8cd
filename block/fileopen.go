package block

// OpenFileFor returns a file opener for a cache mode: O_DIRECT files for
// none and directsync, buffered ones otherwise.
func OpenFileFor(m CacheMode) func(name string, readOnly bool) (File, error) {
	if m.Direct() {
		return func(name string, readOnly bool) (File, error) {
			f, err := OpenFileDirect(name, readOnly)
			if err != nil {
				return nil, err
			}
			return f, nil
		}
	}
	return func(name string, readOnly bool) (File, error) {
		f, err := OpenFile(name, readOnly)
		if err != nil {
			return nil, err
		}
		return f, nil
	}
}
