package redispipe

import (
	"bufio"
	"errors"
	"fmt"
	"strconv"
)

// Value is one RESP2 reply.
type Value struct {
	// Kind is the reply's type byte: '+' simple string, ':' integer, '$'
	// bulk string, '*' array; 0 for a nil bulk string or nil array. A
	// top-level error reply is returned as Error, never as a Value; an
	// error inside an array is an element of Kind '-' with the message in
	// Str.
	Kind byte
	Int  int64
	Str  string
	Arr  []Value
}

// IsNil reports whether v is a nil reply.
func (v Value) IsNil() bool { return v.Kind == 0 }

// Int64s returns an array reply of integers as a slice.
func (v Value) Int64s() ([]int64, error) {
	if v.Kind != '*' {
		return nil, fmt.Errorf("redispipe: reply is %s, not an array", v.kindName())
	}
	out := make([]int64, len(v.Arr))
	for i, x := range v.Arr {
		if x.Kind != ':' {
			return nil, fmt.Errorf("redispipe: array element %d is %s, not an integer", i, x.kindName())
		}
		out[i] = x.Int
	}
	return out, nil
}

func (v Value) kindName() string {
	switch v.Kind {
	case '+':
		return "a simple string"
	case ':':
		return "an integer"
	case '$':
		return "a bulk string"
	case '*':
		return "an array"
	}
	return "nil"
}

// Error is an error reply from Redis (e.g. "NOSCRIPT No matching script").
type Error string

func (e Error) Error() string { return string(e) }

// HasPrefix reports whether err is a Redis error reply starting with p
// (e.g. "NOSCRIPT").
func HasPrefix(err error, p string) bool {
	var e Error
	return errors.As(err, &e) && len(e) >= len(p) && string(e[:len(p)]) == p
}

// errProtocol reports a reply that is not valid RESP2: the connection is
// out of sync and must be closed.
var errProtocol = errors.New("redispipe: protocol error")

// maxBulk bounds a bulk string reply (the limiter never reads large ones).
const maxBulk = 64 << 20

// maxDepth bounds nested arrays.
const maxDepth = 8

// readValue reads one reply. A Redis error reply is returned as the error
// Error (the connection stays usable); any other error (I/O, protocol)
// means the connection is unusable.
func readValue(r *bufio.Reader, depth int) (Value, error) {
	line, err := readLine(r)
	if err != nil {
		return Value{}, err
	}
	if len(line) == 0 {
		return Value{}, fmt.Errorf("%w: empty line", errProtocol)
	}
	switch line[0] {
	case '+':
		return Value{Kind: '+', Str: string(line[1:])}, nil
	case '-':
		return Value{}, Error(line[1:])
	case ':':
		n, err := parseInt(line[1:])
		if err != nil {
			return Value{}, err
		}
		return Value{Kind: ':', Int: n}, nil
	case '$':
		n, err := parseInt(line[1:])
		if err != nil {
			return Value{}, err
		}
		if n < 0 {
			return Value{}, nil
		}
		if n > maxBulk {
			return Value{}, fmt.Errorf("%w: bulk string of %d bytes", errProtocol, n)
		}
		buf := make([]byte, n+2)
		if _, err := readFull(r, buf); err != nil {
			return Value{}, err
		}
		if buf[n] != '\r' || buf[n+1] != '\n' {
			return Value{}, fmt.Errorf("%w: bulk string not terminated", errProtocol)
		}
		return Value{Kind: '$', Str: string(buf[:n])}, nil
	case '*':
		n, err := parseInt(line[1:])
		if err != nil {
			return Value{}, err
		}
		if n < 0 {
			return Value{}, nil
		}
		if depth >= maxDepth || n > 1<<20 {
			return Value{}, fmt.Errorf("%w: array of %d at depth %d", errProtocol, n, depth)
		}
		arr := make([]Value, n)
		for i := range arr {
			v, err := readValue(r, depth+1)
			if re, ok := err.(Error); ok { //nolint:errorlint // readValue returns Error itself, never wrapped
				// An error inside an array (e.g. EXEC): keep reading so the
				// stream stays in sync, and report the first one.
				arr[i] = Value{Kind: '-', Str: string(re)}
				continue
			}
			if err != nil {
				return Value{}, err
			}
			arr[i] = v
		}
		return Value{Kind: '*', Arr: arr}, nil
	}
	return Value{}, fmt.Errorf("%w: unexpected type byte %q", errProtocol, line[0])
}

// readLine returns the next CRLF-terminated line without its terminator;
// the slice is only valid until the next read.
func readLine(r *bufio.Reader) ([]byte, error) {
	line, err := r.ReadSlice('\n')
	if err != nil {
		if errors.Is(err, bufio.ErrBufferFull) {
			return nil, fmt.Errorf("%w: line longer than %d bytes", errProtocol, r.Size())
		}
		return nil, err
	}
	if len(line) < 2 || line[len(line)-2] != '\r' {
		return nil, fmt.Errorf("%w: line not terminated by CRLF", errProtocol)
	}
	return line[:len(line)-2], nil
}

func readFull(r *bufio.Reader, buf []byte) (int, error) {
	n := 0
	for n < len(buf) {
		m, err := r.Read(buf[n:])
		n += m
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

func parseInt(b []byte) (int64, error) {
	if len(b) == 0 {
		return 0, fmt.Errorf("%w: empty integer", errProtocol)
	}
	neg := b[0] == '-'
	if neg {
		b = b[1:]
		if len(b) == 0 {
			return 0, fmt.Errorf("%w: bare minus sign", errProtocol)
		}
	}
	if len(b) > 19 {
		return 0, fmt.Errorf("%w: integer %q too long", errProtocol, b)
	}
	var n int64
	for _, c := range b {
		if c < '0' || c > '9' {
			return 0, fmt.Errorf("%w: bad integer %q", errProtocol, b)
		}
		n = n*10 + int64(c-'0')
		if n < 0 {
			return 0, fmt.Errorf("%w: integer %q overflows", errProtocol, b)
		}
	}
	if neg {
		n = -n
	}
	return n, nil
}

// appendCommand appends one command in RESP2 (an array of bulk strings):
// head (leading string arguments), keys, args (string, []byte, int,
// int64, int32, uint32, bool as 0/1), then rawN arguments already encoded
// in raw.
func appendCommand(b []byte, head []string, keys []string, args []any, raw []byte, rawN int) ([]byte, error) {
	b = append(b, '*')
	b = strconv.AppendInt(b, int64(len(head)+len(keys)+len(args)+rawN), 10)
	b = append(b, '\r', '\n')
	for _, s := range head {
		b = appendBulk(b, s)
	}
	for _, s := range keys {
		b = appendBulk(b, s)
	}
	for i, a := range args {
		switch v := a.(type) {
		case string:
			b = appendBulk(b, v)
		case []byte:
			b = appendBulkBytes(b, v)
		case int:
			b = appendBulkInt(b, int64(v))
		case int64:
			b = appendBulkInt(b, v)
		case int32:
			b = appendBulkInt(b, int64(v))
		case uint32:
			b = appendBulkInt(b, int64(v))
		case bool:
			if v {
				b = appendBulkInt(b, 1)
			} else {
				b = appendBulkInt(b, 0)
			}
		default:
			return b, fmt.Errorf("redispipe: argument %d has unsupported type %T", i, a)
		}
	}
	return append(b, raw...), nil
}

// AppendBulk appends s as a RESP bulk string (an argument of Cmd.Raw).
func AppendBulk(b []byte, s string) []byte { return appendBulk(b, s) }

// AppendBulkInt appends n as a RESP bulk string (an argument of Cmd.Raw).
func AppendBulkInt(b []byte, n int64) []byte { return appendBulkInt(b, n) }

func appendBulk(b []byte, s string) []byte {
	b = append(b, '$')
	b = strconv.AppendInt(b, int64(len(s)), 10)
	b = append(b, '\r', '\n')
	b = append(b, s...)
	return append(b, '\r', '\n')
}

func appendBulkBytes(b []byte, s []byte) []byte {
	b = append(b, '$')
	b = strconv.AppendInt(b, int64(len(s)), 10)
	b = append(b, '\r', '\n')
	b = append(b, s...)
	return append(b, '\r', '\n')
}

func appendBulkInt(b []byte, n int64) []byte {
	var tmp [20]byte
	d := strconv.AppendInt(tmp[:0], n, 10)
	b = append(b, '$')
	b = strconv.AppendInt(b, int64(len(d)), 10)
	b = append(b, '\r', '\n')
	b = append(b, d...)
	return append(b, '\r', '\n')
}
