package membership

import (
	"context"
	"log/slog"

	"go.uber.org/zap/zapcore"
)

// slogCore hands etcd's zap entries at min or above to a slog.Logger, so
// that an embedded etcd logs where the rest of the process does.
type slogCore struct {
	log    *slog.Logger
	min    zapcore.Level
	fields []zapcore.Field
}

func (s slogCore) Enabled(l zapcore.Level) bool { return l >= s.min }

func (s slogCore) With(fs []zapcore.Field) zapcore.Core {
	s.fields = append(append([]zapcore.Field(nil), s.fields...), fs...)
	return s
}

func (s slogCore) Check(e zapcore.Entry, ce *zapcore.CheckedEntry) *zapcore.CheckedEntry {
	if s.Enabled(e.Level) {
		return ce.AddCore(e, s)
	}
	return ce
}

func (s slogCore) Write(e zapcore.Entry, fs []zapcore.Field) error {
	enc := zapcore.NewMapObjectEncoder()
	for _, f := range s.fields {
		f.AddTo(enc)
	}
	for _, f := range fs {
		f.AddTo(enc)
	}
	attrs := make([]slog.Attr, 0, len(enc.Fields)+1)
	attrs = append(attrs, slog.String("component", "etcd"))
	for k, v := range enc.Fields {
		attrs = append(attrs, slog.Any(k, v))
	}
	lvl := slog.LevelInfo
	switch {
	case e.Level >= zapcore.ErrorLevel:
		lvl = slog.LevelError
	case e.Level >= zapcore.WarnLevel:
		lvl = slog.LevelWarn
	case e.Level < zapcore.InfoLevel:
		lvl = slog.LevelDebug
	}
	s.log.LogAttrs(context.Background(), lvl, e.Message, attrs...)
	return nil
}

func (s slogCore) Sync() error { return nil }
