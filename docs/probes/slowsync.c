// LD_PRELOAD shim for fault probes (docs/probes/slow_disk.sh): every fsync
// and fdatasync sleeps SLOWSYNC_MS ms first (default 100), only for files
// under SLOWSYNC_DIR if set (matched on /proc/self/fd/N).
// Build: gcc -O2 -shared -fPIC -o slowsync.so slowsync.c -ldl
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
static int ms = -1; static const char *dir;
static void init(void){ if(ms<0){ const char*e=getenv("SLOWSYNC_MS"); ms=e?atoi(e):100; dir=getenv("SLOWSYNC_DIR"); } }
static int under(int fd){ if(!dir) return 1; char p[64], t[4096]; snprintf(p,sizeof p,"/proc/self/fd/%d",fd); ssize_t n=readlink(p,t,sizeof t-1); if(n<0) return 0; t[n]=0; return strncmp(t,dir,strlen(dir))==0; }
static void delay(int fd){ init(); if(ms>0 && under(fd)){ struct timespec ts={ms/1000,(ms%1000)*1000000L}; nanosleep(&ts,0);} }
int fsync(int fd){ static int(*r)(int); if(!r) r=dlsym(RTLD_NEXT,"fsync"); delay(fd); return r(fd); }
int fdatasync(int fd){ static int(*r)(int); if(!r) r=dlsym(RTLD_NEXT,"fdatasync"); delay(fd); return r(fd); }
