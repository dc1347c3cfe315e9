package usage

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// The spool is a directory of append-only files of frames:
//
//	uint32 big-endian payload length | uint32 big-endian CRC-32C of the payload | payload
//
// where the payload is an encoded UsageEvent. New frames go to the active
// file; the drainer closes it when it wants to replay and reads closed
// files oldest first, deleting each once every frame in it is published.
// A frame is written with one write(2), so a crash leaves at most a torn
// last frame, which replay detects by its length or CRC and skips.
const (
	spoolSuffix    = ".spool"
	frameHeaderLen = 8
	// maxFrameLen bounds one frame's payload; a usage event is well under 4 KiB.
	maxFrameLen = 1 << 20
)

var crcTable = crc32.MakeTable(crc32.Castagnoli)

// errSpoolFull is returned when the spool has reached its size limit.
var errSpoolFull = errors.New("usage spool is full")

type spool struct {
	dir      string
	maxBytes int64

	mu   sync.Mutex // guards f, name, seq
	f    *os.File   // active file, nil until the next append
	name string
	seq  int

	bytes atomic.Int64 // bytes in all spool files
}

func openSpool(dir string, maxBytes int64) (*spool, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("usage spool directory: %w", err)
	}
	s := &spool{dir: dir, maxBytes: maxBytes}
	files, err := s.files()
	if err != nil {
		return nil, err
	}
	for _, f := range files {
		if st, err := os.Stat(f); err == nil {
			s.bytes.Add(st.Size())
		}
	}
	return s, nil
}

// files lists the closed spool files, oldest first.
func (s *spool) files() ([]string, error) {
	entries, err := os.ReadDir(s.dir)
	if err != nil {
		return nil, fmt.Errorf("read usage spool directory: %w", err)
	}
	s.mu.Lock()
	active := s.name
	s.mu.Unlock()
	var out []string
	for _, e := range entries {
		if e.Type().IsRegular() && strings.HasSuffix(e.Name(), spoolSuffix) {
			if p := filepath.Join(s.dir, e.Name()); p != active {
				out = append(out, p)
			}
		}
	}
	slices.Sort(out)
	return out, nil
}

// append writes one frame to the active file.
func (s *spool) append(payload []byte) error {
	if len(payload) > maxFrameLen {
		return fmt.Errorf("usage event of %d bytes exceeds the spool frame limit", len(payload))
	}
	n := int64(frameHeaderLen + len(payload))
	if s.maxBytes > 0 && s.bytes.Load()+n > s.maxBytes {
		return fmt.Errorf("%w (%d bytes, limit %d)", errSpoolFull, s.bytes.Load(), s.maxBytes)
	}
	frame := make([]byte, n)
	binary.BigEndian.PutUint32(frame[0:4], uint32(len(payload)))
	binary.BigEndian.PutUint32(frame[4:8], crc32.Checksum(payload, crcTable))
	copy(frame[frameHeaderLen:], payload)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.f == nil {
		// The directory may have been removed (an empty temporary spool
		// is, at shutdown).
		if err := os.MkdirAll(s.dir, 0o700); err != nil {
			return fmt.Errorf("usage spool directory: %w", err)
		}
		s.seq++
		name := filepath.Join(s.dir, fmt.Sprintf("usage-%020d-%06d%s", time.Now().UnixNano(), s.seq, spoolSuffix))
		f, err := os.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_APPEND|os.O_EXCL, 0o600)
		if err != nil {
			return fmt.Errorf("create usage spool file: %w", err)
		}
		s.f, s.name = f, name
	}
	if _, err := s.f.Write(frame); err != nil {
		// The file may now end in a torn frame; start a new one next time
		// (replay skips the torn tail).
		_ = s.f.Close()
		s.f, s.name = nil, ""
		return fmt.Errorf("write usage spool: %w", err)
	}
	s.bytes.Add(n)
	return nil
}

// rotate closes the active file so the drainer can replay it.
func (s *spool) rotate() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.f == nil {
		return nil
	}
	err := s.f.Close()
	s.f, s.name = nil, ""
	if err != nil {
		return fmt.Errorf("close usage spool file: %w", err)
	}
	return nil
}

// spoolReader reads the frames of one closed spool file.
type spoolReader struct {
	path string
	f    *os.File
	r    *bufio.Reader
	size int64
}

func openSpoolReader(path string) (*spoolReader, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("open usage spool file: %w", err)
	}
	st, err := f.Stat()
	if err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("stat usage spool file: %w", err)
	}
	return &spoolReader{path: path, f: f, r: bufio.NewReaderSize(f, 64<<10), size: st.Size()}, nil
}

// errTornFrame marks a frame cut short or failing its CRC: the file's
// remaining bytes cannot be trusted.
var errTornFrame = errors.New("torn or corrupt frame in usage spool file")

// next returns the next payload, io.EOF at a clean end, or errTornFrame.
func (r *spoolReader) next() ([]byte, error) {
	var h [frameHeaderLen]byte
	if _, err := io.ReadFull(r.r, h[:]); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, io.EOF
		}
		if errors.Is(err, io.ErrUnexpectedEOF) {
			return nil, errTornFrame
		}
		return nil, fmt.Errorf("read usage spool file: %w", err)
	}
	n := binary.BigEndian.Uint32(h[0:4])
	if n > maxFrameLen {
		return nil, errTornFrame
	}
	payload := make([]byte, n)
	if _, err := io.ReadFull(r.r, payload); err != nil {
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			return nil, errTornFrame
		}
		return nil, fmt.Errorf("read usage spool file: %w", err)
	}
	if crc32.Checksum(payload, crcTable) != binary.BigEndian.Uint32(h[4:8]) {
		return nil, errTornFrame
	}
	return payload, nil
}

func (r *spoolReader) close() { _ = r.f.Close() }
